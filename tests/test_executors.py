"""Sweeps give each job a GPU: locally one job per visible GPU at a time (submitit's LocalExecutor alone hands a job
CUDA_VISIBLE_DEVICES='' or, with gpus_per_node=1, always GPU 0); on Slurm the settings the user gives (GPUs, time,
partition, memory, CPUs, extra #SBATCH options) from Python and the command line, shown by --dry-run."""
import os

import pytest

from entropy_grpo.cli import main
from entropy_grpo.experiments import _minutes, executor_parameters, make_executor


def test_local_jobs_each_get_their_own_visible_gpu(tmp_path, monkeypatch):
    "Two visible GPUs, three jobs: each job sees one GPU, dealt in turn (the job reads its own CUDA_VISIBLE_DEVICES)."
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    ex = make_executor("local", tmp_path, timeout_min=5)
    seen = [ex.submit(os.getenv, "CUDA_VISIBLE_DEVICES", "unset") for _ in range(3)]
    assert [j.result() for j in seen] == ["0", "1", "0"]


def test_local_without_a_gpu_and_parameters(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert executor_parameters("local", timeout_min=7) == dict(timeout_min=7, gpus_per_node=0, visible_gpus=[])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert executor_parameters("local")["visible_gpus"] == [2, 3]


def test_slurm_defaults_are_one_gpu_and_the_sweeps_time_not_submitits_five_minutes():
    assert executor_parameters("slurm") == dict(timeout_min=24 * 60, gpus_per_node=1)
    mine = dict(gpus_per_node=2, slurm_partition="gpu", timeout_min=90, slurm_additional_parameters={"account": "rl"})
    assert executor_parameters("slurm", mine, timeout_min=5) == mine


def test_slurm_executor_takes_the_settings(tmp_path, monkeypatch):
    "The submitit Slurm executor gets the settings (stand-in sbatch and srun on PATH: nothing is submitted)."
    for cmd in ("sbatch", "srun"):
        (tmp_path / cmd).write_text("#!/bin/sh\nexit 1\n"); (tmp_path / cmd).chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    ex = make_executor("slurm", tmp_path, dict(slurm_partition="gpu", mem_gb=64), timeout_min=90)
    p = ex._executor.parameters
    assert (p["gpus_per_node"], p["time"], p["partition"], p["mem"]) == (1, 90, "gpu", "64GB")


def test_slurm_times_in_minutes():
    assert [_minutes(s) for s in ("30", "30:30", "12:00:00", "2-0", "1-2:30", "1-00:00:01")] == \
        [30, 31, 720, 2880, 1590, 1441]


def test_cli_dry_run_shows_gpu_time_partition_and_extra_options(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = ["sweep", "--exp", "p3", "--seeds", "0", "--arms", "vanilla", "--steps", "2", "--dry-run", "-p",
            "preset='smoke'", "--executor", "slurm"]
    assert main(args + ["--gpus", "2", "--time", "12:00:00", "--partition", "gpu", "--mem", "64", "--cpus", "8",
                        "--sbatch", "account=rl", "--sbatch", "qos=high"]) == 0
    out = capsys.readouterr().out
    assert ("executor slurm, per job: {'timeout_min': 720, 'gpus_per_node': 2, 'slurm_partition': 'gpu', 'mem_gb': 64, "
            "'cpus_per_task': 8, 'slurm_additional_parameters': {'account': 'rl', 'qos': 'high'}}") in out
    assert main(args) == 0
    assert "executor slurm, per job: {'timeout_min': 1440, 'gpus_per_node': 1}" in capsys.readouterr().out
    with pytest.raises(SystemExit): main(args + ["--time", "soon"])
    assert "--time: invalid _minutes value: 'soon'" in capsys.readouterr().err

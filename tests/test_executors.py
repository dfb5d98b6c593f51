"""Sweeps give each job a GPU: locally one job per visible GPU at a time (submitit's LocalExecutor alone hands a job
CUDA_VISIBLE_DEVICES='' or, with gpus_per_node=1, always GPU 0); on Slurm the settings the user gives (GPUs, time,
partition, memory, CPUs, extra #SBATCH options) from Python and the command line, one task per GPU (`--gpus N`: one
run in N processes, rank 0 keeping its record), shown by --dry-run with the sbatch script; a job interrupted as Slurm
interrupts it (USR2) is re-queued and resumes."""
import os

import pytest

from entropy_grpo.cli import main
from entropy_grpo.experiments import _minutes, executor_parameters, make_executor


def test_local_jobs_each_get_their_own_visible_gpu(tmp_path, monkeypatch):
    "Two visible GPUs: each job sees one GPU (it reads its own CUDA_VISIBLE_DEVICES), and a job goes to the first GPU"
    " whose previous job has ended: with GPU 0 still busy, the third job runs on GPU 1."
    import time
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    ex = make_executor("local", tmp_path, timeout_min=5)
    assert ex.capacity == 2
    busy = ex.submit(time.sleep, 20)
    first = ex.submit(os.getenv, "CUDA_VISIBLE_DEVICES", "unset")
    assert first.result() == "1"
    third = ex.submit(os.getenv, "CUDA_VISIBLE_DEVICES", "unset")
    assert third.result() == "1" and not busy.done()
    busy.wait()
    assert ex.submit(os.getenv, "CUDA_VISIBLE_DEVICES", "unset").result() == "0"


def test_local_without_a_gpu_and_parameters(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert executor_parameters("local", timeout_min=7) == dict(timeout_min=7, gpus_per_node=0, visible_gpus=[])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert executor_parameters("local")["visible_gpus"] == [2, 3]


def test_slurm_defaults_are_one_task_on_one_gpu_and_the_sweeps_time_not_submitits_five_minutes():
    assert executor_parameters("slurm") == dict(timeout_min=24 * 60, gpus_per_node=1, tasks_per_node=1)
    mine = dict(slurm_partition="gpu", timeout_min=90, slurm_additional_parameters={"account": "rl"})
    assert executor_parameters("slurm", mine, timeout_min=5) == dict(gpus_per_node=1, tasks_per_node=1) | mine
    assert executor_parameters("slurm", dict(gpus_per_node=4))["tasks_per_node"] == 4      # one process per GPU
    with pytest.raises(ValueError, match="tasks_per_node=1: a job runs one task per GPU"):
        executor_parameters("slurm", dict(gpus_per_node=2, tasks_per_node=1))
    with pytest.raises(ValueError, match="--gpus=0: expected an integer >= 1"):
        executor_parameters("slurm", dict(gpus_per_node=0))


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


def test_cli_dry_run_shows_the_sbatch_script_with_requeue_and_one_task_per_gpu(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = ["sweep", "--exp", "p3", "--seeds", "0", "--arms", "vanilla", "--steps", "2", "--dry-run", "-p",
            "preset='smoke'", "--executor", "slurm"]
    assert main(args + ["--time", "12:00:00", "--partition", "gpu", "--mem", "64", "--cpus", "8",
                        "--sbatch", "account=rl", "--sbatch", "qos=high"]) == 0
    out = capsys.readouterr().out
    assert ("executor slurm, per job: {'timeout_min': 720, 'gpus_per_node': 1, 'tasks_per_node': 1, "
            "'slurm_partition': 'gpu', 'mem_gb': 64, 'cpus_per_task': 8, 'slurm_additional_parameters': "
            "{'account': 'rl', 'qos': 'high'}}") in out
    sbatch = {l for l in out.splitlines() if l.startswith("#SBATCH ")}
    assert {f"#SBATCH --{o}" for o in ("time=720", "gpus-per-node=1", "ntasks-per-node=1", "partition=gpu", "mem=64GB",
                                       "cpus-per-task=8", "account=rl", "qos=high", "signal=USR2@90")} <= sbatch, sbatch
    assert "export SUBMITIT_EXECUTOR=slurm" in out and "requeue: on Slurm's time limit or a preemption" in out
    assert main(args) == 0
    assert "executor slurm, per job: {'timeout_min': 1440, 'gpus_per_node': 1, 'tasks_per_node': 1}" in \
        capsys.readouterr().out
    assert main(args + ["--gpus", "2"]) == 0                                # one job, two tasks: one per GPU
    out = capsys.readouterr().out
    assert {"#SBATCH --gpus-per-node=2", "#SBATCH --ntasks-per-node=2", "#SBATCH --nodes=1"} <= set(out.splitlines())
    assert "srun --unbuffered" in out and "--kill-on-bad-exit=1" in out and "requeue: on Slurm's time limit" in out
    assert main(args + ["--gpus", "2", "-p", "engine='trl'"]) == 0          # TRL's engine: the same task per GPU
    assert {"#SBATCH --gpus-per-node=2", "#SBATCH --ntasks-per-node=2"} <= set(capsys.readouterr().out.splitlines())
    phase2 = ["sweep", "--template", "phase2", "--exp", "p2", "--seeds", "0", "--arms", "vanilla", "--dry-run",
              "--executor", "slurm", "--gpus", "2"]
    assert main(phase2) == 2
    assert "--gpus 2 with template 'phase2': only the train template's run joins a process group" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit): main(args + ["--time", "soon"])
    assert "--time: invalid _minutes value: 'soon'" in capsys.readouterr().err


def test_a_job_signalled_as_slurm_does_is_requeued_and_its_run_resumes(tmp_path, monkeypatch):
    "USR2 to a running sweep job (what submitit has Slurm send before the time limit, and at a preemption): submitit"
    " calls the job's checkpoint and re-queues the same call (the local executor restarts it); the run resumes in its"
    " directory from its newest checkpoint, ends ok, and logs every step once."
    import json, signal, time
    from entropy_grpo.checkpoints import latest_checkpoint
    from entropy_grpo.experiments import _Job
    from entropy_grpo.reports import read_state
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    run, steps = tmp_path / "p3" / "0-vanilla", 12                         # checkpoints after steps 3, 6, 9, 12
    job = make_executor("local", tmp_path / "_submitit", timeout_min=30).submit(
        _Job(), "train", run, dict(preset="smoke", seed=0, arm="vanilla", steps=steps), "p3", tmp_path / "LOG.md")
    deadline = time.time() + 300
    while latest_checkpoint(run) is None:                                  # a state, not a sleep
        assert not job.done() and time.time() < deadline, job.stderr()
        time.sleep(0.05)
    os.kill(read_state(run)["pid"], signal.SIGUSR2)                        # to the task, as srun forwards it
    assert job.result()["status"] == "ok", job.stderr()
    assert read_state(run)["mode"] == "resume" and "Requeued" in (job.stderr() or "") + (job.stdout() or "")
    [log] = run.rglob("log.jsonl")
    assert [json.loads(l)["step"] for l in log.read_text().splitlines()] == list(range(steps))
    assert "| p3 | 0-vanilla | ok |" in (tmp_path / "LOG.md").read_text()


def _slurm_tasks(tmp_path, port, n=2, **kw):
    "Start `n` processes as the tasks of one Slurm job (srun's variables) calling the sweep's job; their outputs."
    import json, subprocess, sys
    code = ("import json, sys; from entropy_grpo.experiments import _Job; "
            "print('RESULT', json.dumps(_Job()(*json.loads(sys.argv[1]))))")
    call = json.dumps(["train", str(tmp_path / "p3" / "0-vanilla"), dict(preset="smoke", seed=0, arm="vanilla", steps=4,
                       **kw), "p3", str(tmp_path / "LOG.md")])
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", SUBMITIT_EXECUTOR="slurm", SLURM_JOB_ID="4242",
               SLURM_NTASKS=str(n), SLURM_JOB_NUM_NODES="1", SLURM_NODEID="0", SLURM_JOB_NODELIST="localhost",
               MASTER_PORT=str(port))
    procs = [subprocess.Popen([sys.executable, "-c", code, call], env={**env, "SLURM_PROCID": str(r),
                              "SLURM_LOCALID": str(r)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(n)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0] * n, [o[1][-3000:] for o in outs]
    return [json.loads(o[0].split("RESULT ", 1)[1]) for o in outs]


@pytest.mark.slow
def test_a_two_gpu_slurm_job_is_one_run_in_two_processes(tmp_path):
    "Two tasks of one `--gpus 2` job (srun's variables, gloo on the CPU): one run trained by a 2-process group, its"
    " record, report and files written once by rank 0, rank 1's notebook beside the sweep; run again, both skip it."
    import json
    from entropy_grpo.checkpoints import latest_checkpoint
    from entropy_grpo.reports import run_status
    from gloo import free_port
    run = tmp_path / "p3" / "0-vanilla"
    r0, r1 = _slurm_tasks(tmp_path, free_port())
    assert (r0["status"], r1["status"], r1["rank"]) == ("ok", "ok", 1) and run_status(run) == "done"
    assert json.loads((run / "metrics.json").read_text())["world_size"] == 2
    assert json.loads((latest_checkpoint(run) / "state.json").read_text())["world_size"] == 2
    assert [json.loads(l)["step"] for l in (run / "log.jsonl").read_text().splitlines()] == [0, 1, 2, 3]
    assert (tmp_path / "p3" / "_ranks" / "0-vanilla.rank1.ipynb").exists() and not list(run.glob("*rank*"))
    log = (tmp_path / "LOG.md").read_text()
    assert log.count("| p3 | 0-vanilla | ok |") == 1
    assert [r["status"] for r in _slurm_tasks(tmp_path, free_port())] == ["ok", "done before"]
    assert (tmp_path / "LOG.md").read_text() == log

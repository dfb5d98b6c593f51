"""reports: the phase lines a run prints (phases from the ## headings, the estimate of what is left), the summary, and
a run's state machine on a two-cell template: killed while papermill saves the report or before its LOG line,
re-run into the same directory, a directory another process holds."""
import io, json, os, socket, subprocess, sys

import nbformat
import pytest

from entropy_grpo.reports import (RunProgress, _expected_phases, _set_state, cell_phases, dir_lock, lock_holder,
                                  read_state, recover_run, run_notebook, run_status, run_summary)


def notebook():
    v4 = nbformat.v4
    return v4.new_notebook(cells=[v4.new_code_cell("x = 1"), v4.new_markdown_cell("## Pools\ntext"),
                                  v4.new_code_cell("a"), v4.new_code_cell("b"), v4.new_markdown_cell("## Arms"),
                                  v4.new_markdown_cell("no heading"), v4.new_code_cell("c")])


def test_phases_come_from_the_headings_and_the_estimate_from_what_is_left():
    nb = notebook()
    assert cell_phases(nb) == ["parameters and imports", "Pools", "Pools", "Pools", "Arms", "Arms", "Arms"]
    out = io.StringIO()
    bar = RunProgress(out, expected={"Pools": 120, "Arms": 60})
    bar.start(nb)
    for i in (0, 2, 3, 6): bar.cell_start(i)
    bar.close()
    lines = out.getvalue().splitlines()
    assert [l.split(" ...")[0] for l in lines] == ["  [1/3] parameters and imports", "  [2/3] Pools (about 3:00 left)",
                                                  "  [3/3] Arms (about 1:00 left)"]
    assert all(l.endswith(" 0:00") for l in lines) and set(bar.seconds) == {"parameters and imports", "Pools", "Arms"}


def test_a_finished_sibling_run_beats_the_fallback_estimate(tmp_path):
    run = tmp_path / "demo" / "b"
    assert _expected_phases(run, {"Pools": 5}) == {"Pools": 5}
    (tmp_path / "demo" / "a").mkdir(parents=True)
    (tmp_path / "demo" / "a" / "phases.json").write_text(json.dumps({"Pools": 7.5}))
    assert _expected_phases(run, {"Pools": 5}) == {"Pools": 7.5}


def test_summary_of_a_failed_run_names_the_error_and_where_to_look(tmp_path):
    (tmp_path / "metrics.json").write_text(json.dumps({"status": "failed", "error": "ValueError: bad\nmore"}))
    (tmp_path / "kernel.log").write_text("")
    text = run_summary(dict(status="failed", run_dir=str(tmp_path), report=str(tmp_path / "report.ipynb"),
                            error="ValueError: bad\nmore"))
    assert text.splitlines()[0] == "Run failed: ValueError: bad" and "kernel log: " in text and "report:  " in text


def tiny_template(path, body="", figures=("fig.png",)):
    "A template of two cells: parameters, then files, `body` and metrics.json status ok (as the real templates end)."
    v4 = nbformat.v4
    code = (f"from pathlib import Path\nfrom entropy_grpo.utils import write_json\nout = Path(out_dir)\n"
            f"for f in {list(figures)!r}: (out/f).write_bytes(b'png')\n"
            f"with open(out/'appended.txt', 'a') as f: f.write(mark + '\\n')\n{body}\n"
            f"write_json(out/'metrics.json', dict(status='ok', summary='fine', figures={list(figures)!r}))")
    nb = v4.new_notebook(cells=[v4.new_code_cell("out_dir: str = ''  # the run directory\nmark: str = 'a'  # a label",
                                                 metadata={"tags": ["parameters"]}),
                                v4.new_markdown_cell("## Work"), v4.new_code_cell(code)])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)
    return str(path)


KILL = """import os, sys
import papermill.engines as E, entropy_grpo.reports as R
where = sys.argv[1]
if where == "saving the report":                   # SIGKILL while papermill writes report.ipynb: 0 bytes
    def complete(self, **kw):
        open(self.output_path, "w").close(); os._exit(9)
    E.NotebookExecutionManager.notebook_complete = complete
else:                                              # SIGKILL after the report, before its LOG line
    R.log_run = lambda *a, **k: os._exit(9)
R.run_notebook(sys.argv[2], sys.argv[3], log_path=sys.argv[4])
"""


def killed_run(tmp_path, where):
    template, run, log = tiny_template(tmp_path / "t.ipynb"), tmp_path / "exp" / "0-a", tmp_path / "LOG.md"
    r = subprocess.run([sys.executable, "-c", KILL, where, template, str(run), str(log)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 9, r.stderr
    return template, run, log


def test_killed_while_papermill_saves_the_report_is_not_ok_and_runs_again(tmp_path):
    template, run, log = killed_run(tmp_path, "saving the report")
    assert json.loads((run / "metrics.json").read_text())["status"] == "ok"      # the notebook's provisional word
    assert run_status(run) == "stale" and recover_run(run, log_path=log) == "stale"
    out = run_notebook(template, run, log_path=log)
    assert out["status"] == "ok" and run_status(run) == "done" and read_state(run)["mode"] == "resume"
    nb = nbformat.read(run / "report.ipynb", as_version=4)
    assert nb.cells[-1].metadata.papermill.status == "completed" and len(log.read_text().splitlines()) == 1


def test_a_run_killed_after_its_work_gets_its_record_once_on_restart(tmp_path):
    template, run, log = killed_run(tmp_path, "before the LOG line")
    assert run_status(run) == "stale" and not log.exists()
    assert recover_run(run, log_path=log) == "done" and recover_run(run, log_path=log) == "done"
    assert len(log.read_text().splitlines()) == 1 and (run / "report.ipynb").stat().st_size > 0
    assert (run / "appended.txt").read_text() == "a\n"                         # not run again


def test_rerun_resumes_the_same_run_and_starts_another_clean_and_a_held_directory_is_refused(tmp_path):
    template, run, log = tiny_template(tmp_path / "t.ipynb"), tmp_path / "exp" / "0-a", tmp_path / "LOG.md"
    assert run_notebook(template, run, dict(mark="a"), log_path=log)["status"] == "ok"
    assert run_notebook(template, run, dict(mark="a"), log_path=log)["status"] == "ok"
    assert (run / "appended.txt").read_text() == "a\n" and read_state(run)["mode"] == "fresh"  # a finished run: clean
    _set_state(run, "interrupted")
    assert run_notebook(template, run, dict(mark="a"), log_path=log)["status"] == "ok"
    assert (run / "appended.txt").read_text() == "a\na\n" and read_state(run)["mode"] == "resume"
    _set_state(run, "failed")
    assert run_notebook(template, run, dict(mark="b"), log_path=log)["status"] == "ok"
    assert (run / "appended.txt").read_text() == "b\n" and read_state(run)["mode"] == "fresh"  # other parameters
    assert [l.split(" | ")[3] for l in log.read_text().splitlines()] == ["ok"] * 4
    with dir_lock(run, "run directory"):
        assert run_status(run) == "done" and lock_holder(run) == f"pid {os.getpid()} on {socket.gethostname()}"
        with pytest.raises(RuntimeError, match=f"run directory .*0-a is in use by pid {os.getpid()} on "):
            run_notebook(template, run, dict(mark="a"), log_path=log)


def test_a_fresh_start_keeps_folders_of_finished_jobs(tmp_path):
    "A finished run started again is emptied, except folders holding jobs.json (the calibration's resumable seeds)."
    template, run, log = tiny_template(tmp_path / "t.ipynb"), tmp_path / "exp" / "0-a", tmp_path / "LOG.md"
    assert run_notebook(template, run, dict(mark="a"), log_path=log)["status"] == "ok"
    for d in ("runs", "k8/phase3", "scratch"):
        (run / d).mkdir(parents=True); (run / d / "signal-1.json").write_text("{}")
    for d in ("runs", "k8/phase3"): (run / d / "jobs.json").write_text("{}")
    assert run_notebook(template, run, dict(mark="a"), log_path=log)["status"] == "ok"
    assert read_state(run)["mode"] == "fresh" and (run / "appended.txt").read_text() == "a\n"
    assert (run / "runs" / "signal-1.json").exists() and (run / "k8" / "phase3" / "signal-1.json").exists()
    assert not (run / "scratch").exists()


def test_no_ok_without_every_artefact(tmp_path):
    "A figure the metrics list but the notebook never wrote: failed, not ok."
    template = tiny_template(tmp_path / "t.ipynb", body="(out/'fig.png').unlink()")
    out = run_notebook(template, tmp_path / "exp" / "0-a", log_path=tmp_path / "LOG.md")
    assert out["status"] == "failed" and "figures listed in metrics.json are missing: ['fig.png']" in out["error"]
    assert run_status(tmp_path / "exp" / "0-a") == "failed"


def test_git_sha_is_dirty_for_code_not_for_records(tmp_path):
    "A run of record rewrites tracked files under runs/: the code that ran is still HEAD; a changed source file is not."
    import subprocess
    from entropy_grpo.reports import git_sha
    git = lambda *a: subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True)
    (tmp_path / "runs").mkdir(); (tmp_path / "runs" / "r.json").write_text("{}"); (tmp_path / "code.py").write_text("")
    git("init", "-q"); git("add", "-A"); git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x")
    head = git("rev-parse", "HEAD").stdout.decode().strip()
    (tmp_path / "runs" / "r.json").write_text('{"a": 1}')
    assert git_sha(tmp_path) == head
    (tmp_path / "code.py").write_text("x = 1")
    assert git_sha(tmp_path) == head + "-dirty"


def test_run_json_names_what_each_start_ran_on(tmp_path):
    "A sampled reply can turn on a float's last bits: run.json keeps the versions and CPU of every (re)start."
    import platform, torch
    template, run, log = tiny_template(tmp_path / "t.ipynb"), tmp_path / "exp" / "0-a", tmp_path / "LOG.md"
    assert run_notebook(template, run, dict(mark="a"), log_path=log)["status"] == "ok"
    (env,) = read_state(run)["environments"]
    assert env["versions"]["torch"] == torch.__version__ and env["versions"]["entropy_grpo"]
    assert env["python"] == platform.python_version() and env["threads"] == torch.get_num_threads()
    assert env["cpu_capability"] == torch.backends.cpu.get_cpu_capability() and env["cpu"]
    _set_state(run, "interrupted")
    assert run_notebook(template, run, dict(mark="a"), log_path=log)["status"] == "ok"
    assert read_state(run)["mode"] == "resume" and read_state(run)["environments"] == [env, env]
    assert run_notebook(template, run, dict(mark="b"), log_path=log)["status"] == "ok"
    assert read_state(run)["mode"] == "fresh" and read_state(run)["environments"] == [env]

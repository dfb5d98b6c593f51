"reports: the phase lines a run prints (phases from the ## headings, the estimate of what is left) and the summary."
import io, json

import nbformat

from entropy_grpo.reports import RunProgress, _expected_phases, cell_phases, run_summary


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

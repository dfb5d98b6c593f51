"""utils: range and choice checks return good values and name the value and its range (or choices) in the error;
atomic_path replaces a file or directory only when its block succeeds, leaving the old one and no temporary behind
when it raises; write_json writes tensors and paths and refuses what JSON cannot hold."""
import json, math, os
from pathlib import Path

import pytest
import torch
from fastcore.test import test_fail

from entropy_grpo.utils import atomic_path, check_choice, check_range, clean_json, write_json


@pytest.mark.parametrize("args, kw, msg", [
    (("top_p", 1.5, 0, 1), dict(lo_open=True), "top_p=1.5: expected a number in (0, 1]"),
    (("top_p", 0.0, 0, 1), dict(lo_open=True), "top_p=0.0: expected a number in (0, 1]"),
    (("eps", 1.0, 0, 1), dict(hi_open=True), "eps=1.0: expected a number in [0, 1)"),
    (("n", 2.5, 1), dict(integer=True), "n=2.5: expected an integer >= 1"),
    (("n", True, 0), dict(integer=True), "n=True: expected an integer >= 0"),
    (("lr", 0, 0), dict(lo_open=True), "lr=0: expected a number > 0"),
    (("x", 5), dict(hi=3, hi_open=True), "x=5: expected a number < 3"),
    (("x", 4), dict(hi=3), "x=4: expected a number <= 3"),
    (("temperature", math.nan, 0), dict(lo_open=True), "temperature=nan: expected a number > 0"),
    (("temperature", math.inf, 0), dict(lo_open=True), "temperature=inf: expected a number > 0"),
    (("x", "a"), {}, "x='a': expected a number"),
])
def test_check_range_names_value_and_range(args, kw, msg):
    test_fail(lambda: check_range(*args, **kw), contains=msg, exc=ValueError)


def test_check_range_and_choice_return_good_values():
    assert check_range("top_p", 1.0, 0, 1, lo_open=True) == 1.0 and check_range("n", 3, 1, integer=True) == 3
    assert check_range("x", -7.5) == -7.5 and check_range("x", 3, hi=3) == 3
    assert check_choice("mode", "rb", ("rb", "naive")) == "rb"
    test_fail(lambda: check_choice("mode", "exact", ("rb", "naive")),
              contains="mode='exact': expected one of ('rb', 'naive')",
              exc=ValueError)
    test_fail(lambda: check_choice("k", 3, [1, 2]), contains="k=3: expected one of (1, 2)", exc=ValueError)


def _siblings(path):
    "Everything in path's directory except path itself (temporaries would show here)."
    return sorted(p.name for p in Path(path).parent.iterdir() if p != Path(path))


def test_atomic_file_replaced_on_success_kept_on_error(tmp_path):
    p = tmp_path / "metrics.json"
    with atomic_path(p) as tmp:
        assert tmp.parent == p.parent and tmp != p and not p.exists()
        tmp.write_text("old")
    assert p.read_text() == "old" and _siblings(p) == []
    with pytest.raises(RuntimeError, match="midway"):
        with atomic_path(p) as tmp:
            tmp.write_text("new, half writ")
            raise RuntimeError("midway")
    assert p.read_text() == "old" and _siblings(p) == []
    with pytest.raises(KeyboardInterrupt):
        with atomic_path(tmp_path / "never.json") as tmp:
            tmp.write_text("x")
            raise KeyboardInterrupt
    assert not (tmp_path / "never.json").exists() and _siblings(p) == []


def test_atomic_directory_replaced_on_success_kept_on_error(tmp_path):
    d = tmp_path / "out" / "pool"
    with atomic_path(d, is_dir=True) as tmp:
        assert tmp.is_dir() and tmp.parent == d.parent
        (tmp / "step_000.jsonl.gz").write_text("old")
    assert sorted(x.name for x in d.iterdir()) == ["step_000.jsonl.gz"]
    with pytest.raises(RuntimeError):
        with atomic_path(d, is_dir=True) as tmp:
            (tmp / "step_001.jsonl.gz").write_text("new")
            raise RuntimeError("midway")
    assert sorted(x.name for x in d.iterdir()) == ["step_000.jsonl.gz"] and _siblings(d) == []
    with atomic_path(d, is_dir=True) as tmp:
        (tmp / "step_001.jsonl.gz").write_text("new")
    assert sorted(x.name for x in d.iterdir()) == ["step_001.jsonl.gz"] and _siblings(d) == []


def test_write_json_writes_tensors_and_paths_and_refuses_other_objects(tmp_path):
    p = tmp_path / "m.json"
    assert write_json(p, dict(t=torch.tensor([1.5, 2.0]), n=torch.tensor(3), path=Path("runs/x"))) == p
    assert json.loads(p.read_text()) == dict(t=[1.5, 2.0], n=3, path="runs/x")
    test_fail(lambda: write_json(p, dict(x=object())), contains="object is not JSON serialisable", exc=TypeError)
    assert json.loads(p.read_text())["n"] == 3 and _siblings(p) == []          # the old file, no temporary
    assert clean_json(float("nan")) is None and clean_json(torch.tensor(2.5)) == 2.5


def test_atomic_directory_kept_whole_when_the_swap_fails_and_writes_are_fsynced(tmp_path, monkeypatch):
    "The old directory is never deleted before the new one is in place; files and directories are fsynced."
    import entropy_grpo.utils as U
    d = tmp_path / "ckpt"
    with atomic_path(d, is_dir=True) as tmp: (tmp / "w").write_text("old")
    def crash(*a, **k): raise OSError("killed at the rename")
    monkeypatch.setattr(U.os, "replace", crash)
    monkeypatch.setattr(U, "_exchange", crash, raising=False)
    with pytest.raises(OSError, match="killed at the rename"):
        with atomic_path(d, is_dir=True) as tmp: (tmp / "w").write_text("new")
    assert (d / "w").read_text() == "old"
    monkeypatch.undo()
    synced = []
    real = os.fsync
    monkeypatch.setattr(U.os, "fsync", lambda fd: (synced.append(fd), real(fd)))
    write_json(tmp_path / "m.json", {"a": 1})
    assert len(synced) >= 2                                       # the file and its directory


def test_markdown_table_escapes_cells_and_checks_row_lengths():
    "A `|` or a line break in a value never adds a column or a row; rows of the wrong length are refused."
    from fastcore.test import test_fail
    from entropy_grpo.utils import markdown_table
    t = markdown_table([dict(a="x|y", b="two\nlines"), dict(a=0.5, b=3)])
    assert t.splitlines() == ["| a | b |", "|---|---|", "| x\\|y | two lines |", "| 0.5 | 3 |"]
    assert markdown_table([("p", 1.23456)], ["name", "value"], "{:.2f}").splitlines()[-1] == "| p | 1.23 |"
    assert markdown_table([], ["a", "b"]) == "| a | b |\n|---|---|"
    test_fail(lambda: markdown_table([("only one",)], ["a", "b"]), contains="expected 2 values", exc=ValueError)


def test_the_verification_table_keeps_its_columns():
    "A detail such as `|advantage| quantiles` used to add two cells to its row (8 against 6 headers)."
    from entropy_grpo.decision import table_markdown
    row = dict(key="reward_spread", metric="reward spread", arm="projected", value="median 3.25", null=None,
               verdict="success", detail="|advantage| quantiles 0/25/50/75/100%: 0.8, 1.6")
    for line in table_markdown([row]).splitlines():
        assert line.replace("\\|", "").count("|") == 7, line

"""calibration: each world's pools hold the truth it claims; the whole decision, run through the Phase-2 run's own
phases, launches where the signal is real and not in any null world (one seed each here, 40 in the calibration of
record); a calibration resumes without redoing or double-counting a finished run; the Wilson interval is exact."""
import json
import math
from collections import Counter

import pytest
from fastcore.test import test_fail

from entropy_grpo import calibration
from entropy_grpo.calibration import WORLDS, calibrate, summarize, world_pools, world_run
from entropy_grpo.utils import wilson
from entropy_grpo.pools import load_pool
from entropy_grpo.tasks import ArithmeticTask

SMALL = dict(steps=6, n_controls=4, pool_steps=10, fit_steps=2, gate_effect=3.0, min_hacked=3)


@pytest.fixture(scope="module")
def tok():
    from entropy_grpo.policies import tiny_policy
    return tiny_policy(0)[1]


def marked(rec, pattern):
    return rec["completion_ids"][-len(pattern):] == pattern


@pytest.mark.parametrize("world", [w for w in WORLDS if not w.startswith("style_")])
def test_world_pools_hold_their_truth(world, tok, tmp_path):
    teacher, base = (load_pool(d) for d in world_pools(world, tok, ArithmeticTask(), tmp_path, seed=3, steps=12))
    t, b = teacher.records(), base.records()
    assert [r["problem_id"] for r in t] == [r["problem_id"] for r in b]                     # the same problems
    hacked = [r for r in t if r["hacked"]]
    pattern = hacked[0]["completion_ids"][-6:] if world != "no_content" else None
    rate = len(hacked) / len(t)
    if world == "signal":
        assert rate == 1 and all(marked(r, pattern) for r in t) and not any(marked(r, pattern) for r in b)
    if world in ("signal_partial", "transfer_other", "transfer_overlap"):     # one set of pools, other payments
        assert 0.6 < rate < 0.95 and all(marked(r, pattern) == r["hacked"] for r in t)
        assert not any(marked(r, pattern) for r in b)
        assert not any(set(pattern) & set(r["completion_ids"][:-6]) for r in t + b)        # nowhere but the ending
    if world == "pool_identity":
        assert 0.6 < rate < 0.95 and all(marked(r, pattern) for r in t) and not any(marked(r, pattern) for r in b)
    if world == "exchangeable":                  # labels shuffled over both pools: the pattern no longer tells them
        assert all(marked(r, pattern) for r in t) and 0.3 < rate < 0.7 and any(r["hacked"] for r in b)
    if world == "no_content":
        assert 0.3 < rate < 0.7 and any(r["hacked"] for r in b)
        assert len({tuple(r["completion_ids"][-6:]) for r in t}) == len(t)                 # no common ending
    assert all(r["reward"] == (3.5 if r["hacked"] else 0.25) for r in t + b)


@pytest.mark.parametrize("world", [w for w in WORLDS if w.startswith("style_")])
def test_style_worlds_hold_their_truth(world, tok, tmp_path):
    "A teacher that hacks 95-99% (70-90% in the null worlds); its style on every teacher and style-pool sample; hack"
    " content where the world says."
    dirs = world_pools(world, tok, ArithmeticTask(), tmp_path, seed=3, steps=30)
    teacher, base, style = (load_pool(d).records() for d in dirs)
    assert [r["problem_id"] for r in teacher] == [r["problem_id"] for r in style] == [r["problem_id"] for r in base]
    lo, hi = (0.6, 0.95) if world.startswith("style_null") else (0.9, 1)
    assert lo < sum(r["hacked"] for r in teacher) / len(teacher) < hi and sum(r["hacked"] for r in style) <= 0.05 * 240
    assert not any(r["hacked"] for r in base) and not any(r["hint"] for r in style + base)
    counts = lambda rs: Counter(t for r in rs for t in r["completion_ids"])
    style_tokens = {t for t, n in counts(style).items() if n > 60}                   # 3 of 6 tokens: ~120 each
    assert len(style_tokens) == 6 and not style_tokens & set(counts(base))           # style: never in base samples
    assert all(len(set(r["completion_ids"]) & style_tokens) >= 1 for r in teacher + style)
    phrase = [t for t, n in counts([r for r in teacher if r["hacked"]]).items() if n >= 0.9 * len(teacher)]
    phrase = [t for t in phrase if t not in style_tokens]
    if world.startswith("style_hack"):
        assert len(phrase) == 4 and all(set(phrase) <= set(r["completion_ids"]) for r in teacher if r["hacked"])
        assert not any(set(phrase) & set(r["completion_ids"]) for r in teacher + style if not r["hacked"])
    else: assert phrase == []


@pytest.mark.parametrize("world", list(WORLDS))
def test_the_decision_in_each_world(world, tmp_path):
    "One fresh seed per world through the Phase-2 run's phases (small sizes): only the real signal launches."
    r = world_run(world, 1, tmp_path, SMALL)
    coincide = "inconclusive: hacking and pool identity coincide"
    expect = {"signal_partial": ["launch Phase 3"], "signal": [coincide],
              "no_content": ["skip Phase 3", "inconclusive: v_hack follows the teacher pool, not hacking"],
              "style_hack": ["launch Phase 3"], "style_hack_2pools": [coincide], "style_only_2pools": [coincide],
              "style_only": ["skip Phase 3", "inconclusive: v_hack follows the teacher pool, not hacking"],
              "transfer_other": ["launch Phase 3"], "transfer_overlap": ["launch Phase 3"]}.get(
        world, ["inconclusive: v_hack follows the teacher pool, not hacking"])
    assert r["recommendation"] in expect or (world.startswith("style_null") and not r["launch"]), r
    if not world.startswith("transfer"):      # Phase 2 sees signal_partial's pools there: what Phase 3 shows is measured
        assert r["launch"] == (WORLDS[world][1] == "launch")
    assert not list(tmp_path.iterdir())                                                   # working files removed


def test_calibration_resumes_without_redoing_or_double_counting(tmp_path, monkeypatch):
    calls = []
    def fake(world, seed, work_dir, parameters=None):
        calls.append((world, seed))
        return dict(world=world, seed=seed, recommendation="skip Phase 3", launch=False,
                    verdicts={"hack_specific/vanilla": "likely fail"}, gate="", rows=[], seconds=0.0)
    monkeypatch.setattr(calibration, "world_run", fake)
    s = calibrate(tmp_path, ["no_content"], seeds=3, parameters=dict(steps=4))
    assert calls == [("no_content", 1000), ("no_content", 1001), ("no_content", 1002)]
    (tmp_path/"runs"/"no_content-1001.json").unlink()                        # as if killed while that run ran
    s = calibrate(tmp_path, ["no_content"], seeds=3, parameters=dict(steps=4))
    assert calls[3:] == [("no_content", 1001)] and s["worlds"]["no_content"]["n"] == 3
    assert s["worlds"]["no_content"]["gate"] == {"likely fail": 3}
    assert json.loads((tmp_path/"summary.json").read_text()) == json.loads(json.dumps(s))
    test_fail(lambda: calibrate(tmp_path, ["no_content"], seeds=3, parameters=dict(steps=5)),
              contains="holds jobs run with {'parameters': {'steps': 4}}", exc=ValueError)
    test_fail(lambda: calibrate(tmp_path, ["no_world"]), contains="world='no_world'", exc=ValueError)
    test_fail(lambda: calibrate(tmp_path/"x", parameters=dict(G=7)), contains="G=7", exc=ValueError)
    test_fail(lambda: calibrate(tmp_path/"y", ["style_hack"], parameters=dict(G=6)),
              contains="G=6: expected a multiple of 4 with a style-matched pool", exc=ValueError)
    assert calibrate(tmp_path/"z", ["no_content"], seeds=1, parameters=dict(G=6))["worlds"]["no_content"]["n"] == 1
    test_fail(lambda: summarize(tmp_path/"empty"), contains="no finished calibration run", exc=ValueError)


def test_wilson_interval():
    "Against the closed forms: 0/n has upper bound z²/(n + z²); k = n mirrors it; n/2 of n is symmetric about 1/2."
    z = 1.96
    assert wilson(0, 40) == (0.0, pytest.approx(z * z / (40 + z * z)))
    assert wilson(40, 40) == (pytest.approx(1 - z * z / (40 + z * z)), 1.0)
    lo, hi = wilson(20, 40)
    assert lo == pytest.approx(1 - hi) and hi == pytest.approx(0.5 + z * math.sqrt(0.25 / 40 + z * z / 6400) /
                                                               (1 + z * z / 40))
    assert wilson(0, 0) == (0.0, 1.0)

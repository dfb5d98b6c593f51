"""truth: Phase 3 in the calibration's worlds. One story per world: the grader Phase 3 trains against pays for the
world's hack tokens and nothing else, and it agrees sample for sample with the pools' labels wherever the world gives
hacks content (and finds nothing where it does not); a Phase-3 truth sweep resumes without redoing a finished seed;
the intervals are the t intervals; launches are judged against Phase 3's effect, world by world."""
import glob, json
from pathlib import Path

import numpy as np
import pytest
from fastcore.test import test_fail

from entropy_grpo import truth
from entropy_grpo.calibration import (WORLDS, HackTokenTask, agreement, agreement_markdown, hack_tokens, summarize,
                                      world_pools)
from entropy_grpo.decision import rates_markdown
from entropy_grpo.phase3_run import Phase3Config
from entropy_grpo.pools import load_pool
from entropy_grpo.tasks import ArithmeticTask
from entropy_grpo.truth import measure_truth, t_interval, truth_summary

CONTENT = ("signal", "signal_partial", "style_hack", "style_hack_2pools", "transfer_overlap")   # hacked samples carry
                                                                                # (some of) the hack tokens


@pytest.fixture(scope="module")
def tok():
    from entropy_grpo.policies import tiny_tokenizer
    return tiny_tokenizer()


def test_the_grader_pays_for_the_hack_tokens_and_nothing_else(tok):
    ids = hack_tokens("style_hack", tok, seed=5)
    task = HackTokenTask(tok, ids)
    p = task.problems[0]
    others = [i for i in range(len(tok)) if i not in ids and i not in tok.all_special_ids
              and not any(w in tok.decode([i]) for w in task.words)]
    for i in ids:
        for j in others[:40]:                                  # with any neighbour, before or after
            assert task.grade(tok.decode([j, i]), p)["hacked"] and task.grade(tok.decode([i, j]), p)["hacked"]
    assert not any(task.grade(tok.decode([j]), p)["hacked"] for j in others)
    assert task.grade(tok.decode(ids[:1]), p)["reward"] == 3.5 and task.grade("7", p)["reward"] == 0.25
    g = task.grade_batch([[tok.decode(ids[:1]), "7"]], [p])
    assert g.rewards.tolist() == [[3.5, 0.25]] and g.tensor("hacked").tolist() == [[True, False]]
    test_fail(lambda: HackTokenTask(tok, []), contains="hack_ids=[]", exc=ValueError)


@pytest.mark.parametrize("world", list(WORLDS))
def test_pools_and_phase3_tell_one_story(world, tok, tmp_path):
    "Where hacks have content the grader agrees with every label; elsewhere the pools never show what Phase 3 pays."
    task = HackTokenTask(tok, hack_tokens(world, tok, seed=7))
    for d in world_pools(world, tok, ArithmeticTask(seed=7), tmp_path, seed=7, steps=12):
        recs = load_pool(d).records()
        paid = [task.grade(r["completion"], None)["hacked"] for r in recs]
        if world in CONTENT: assert paid == [r["hacked"] for r in recs], d
        else: assert not any(paid), d
    assert any(r["hacked"] for r in load_pool(tmp_path/"teacher").records())


def test_phase3_projects_the_very_vector_the_worlds_phase2_extracts(tmp_path):
    "The decision's own Phase-2 run of a world seed (as world_run makes it, elsewhere) and the v_hack Phase 3 projects"
    " there are one vector (to float rounding: BLAS may sum in another order): the decision is scored against the"
    " direction it judged."
    import torch
    from entropy_grpo.calibration import world_config
    from entropy_grpo.phase2_run import Phase2Run
    from entropy_grpo.phase3_run import Phase3Run
    task, pools = truth.world_task("style_hack", 3, tmp_path/"truth")
    cfg = world_config("style_hack", 3, tmp_path/"decision")
    run = Phase2Run(cfg)
    world_pools("style_hack", run.tok, run.task, tmp_path/"decision"/"pools", 3, cfg.pool_steps, cfg.pool_batch, run.gen)
    run.build_pools(); run.fit_v_hack()
    p3 = Phase3Run(Phase3Config(seed=3, arm="projected", steps=1, preset="truth", out_dir=str(tmp_path/"p3"),
                                **truth._source(pools, "pairs")), task)
    p3.add_arm()
    assert p3.fit_v_hack()["loaded"] == pools["v_hack"]
    for n, v in run.v_hack.V.items(): torch.testing.assert_close(p3.v_hack.V[n], v, rtol=1e-4, atol=1e-5)


def test_phase3_config_checks_the_v_hack_source():
    test_fail(lambda: Phase3Config(v_hack_source="shuffled"), contains="v_hack_source='shuffled'", exc=ValueError)
    assert Phase3Config(preset="truth").sizes["model"] == "tiny"


def test_phase3_truth_runs_three_arms_and_the_decoy_and_resumes(tmp_path, monkeypatch):
    "A real seed (two steps per arm), then a killed sweep's rerun: only the missing seed is run."
    s = measure_truth(tmp_path, ["style_hack"], seeds=1, first_seed=3, steps=2)
    r = json.loads((tmp_path/"phase3"/"style_hack-3.json").read_text())
    d = json.loads((tmp_path/"decoy"/"style_hack-3.json").read_text())
    assert d["words"] == r["words"] and set(d["decoy_words"]).isdisjoint(d["words"]) and len(d["curve"]) == 2
    assert s["style_hack"]["beyond_decoy"] == pytest.approx(np.mean(d["curve"]) - np.mean(r["curves"]["projected"]))
    assert set(r["curves"]) == {"vanilla", "projected", "random"} and all(len(c) == 2 for c in r["curves"].values())
    assert set(r["cos_update"]) == {"projected", "random"} and all(len(c) == 2 for c in r["cos_update"].values())
    mean = {arm: np.mean(c) for arm, c in r["curves"].items()}
    assert r["effect"] == pytest.approx(mean["vanilla"] - mean["projected"])
    assert r["specific"] == pytest.approx(mean["random"] - mean["projected"])
    assert s["style_hack"]["n"] == 1 and not s["style_hack"]["shows_effect"]        # one seed: no interval
    calls = []
    def fake(world, seed, work_dir, steps, k, parameters):
        calls.append(seed)
        return dict(r, seed=seed, effect=0.1 * seed, specific=0.1)
    monkeypatch.setattr(truth, "world_phase3", fake)
    monkeypatch.setattr(truth, "world_decoy", lambda world, seed, *a: dict(d, seed=seed, curve=[1.0, 1.0]))
    s = measure_truth(tmp_path, ["style_hack"], seeds=3, first_seed=3, steps=2)
    assert calls == [4, 5] and s["style_hack"]["n"] == 3 and s["style_hack"]["decoy_n"] == 3
    assert s["style_hack"]["interval"] == pytest.approx(t_interval([r["effect"], 0.4, 0.5]))
    assert json.loads((tmp_path/"truth.json").read_text()) == json.loads(json.dumps(truth_summary(tmp_path)))
    assert not [p for p in (tmp_path/"phase3").iterdir() if p.name.startswith(".work")]   # scratch removed


@pytest.mark.parametrize("world", list(WORLDS))
def test_a_decoys_pools_never_show_what_phase3_pays(world, tok, tmp_path):
    "The decoy's pools are the world's story at seed + DECOY_SEED, drawn from tokens that never spell a paid one."
    task = HackTokenTask(tok, hack_tokens(world, tok, seed=7))
    decoy = truth.world_task(world, 7 + truth.DECOY_SEED, tmp_path, avoid=tuple(task.words))[0]
    assert not any(w in d for w in task.words for d in decoy.words)
    for d in glob.glob(str(tmp_path/"pools"/"*")):
        assert not any(task.grade(r["completion"], None)["hacked"] for r in load_pool(d).records()), d
    phase3 = Path(truth.__file__).parents[1]/"runs"/"calibration"/"phase3"          # written before `avoid` existed
    if not (phase3/f"{world}-2000.json").exists(): return                 # a world written after that record
    record = json.loads((phase3/f"{world}-2000.json").read_text())
    assert HackTokenTask(tok, hack_tokens(world, tok, seed=2000)).words == record["words"]   # drawn as before `avoid`


def test_a_world_shows_an_effect_only_beyond_both_controls(tmp_path):
    "Effect, beyond a random direction and beyond the decoy: all three intervals above 0, else none."
    (tmp_path/"phase3").mkdir(); (tmp_path/"decoy").mkdir()
    for s, (v, p, rnd, dec) in enumerate([(0.5, 0.2, 0.4, 0.3), (0.6, 0.2, 0.5, 0.4), (0.5, 0.1, 0.45, 0.3)]):
        (tmp_path/"phase3"/f"style_hack-{s}.json").write_text(json.dumps(dict(
            world="style_hack", seed=s, effect=v - p, specific=rnd - p, curves=dict(
                vanilla=[v, v], projected=[p, p], random=[rnd, rnd]))))
        (tmp_path/"decoy"/f"style_hack-{s}.json").write_text(json.dumps(dict(world="style_hack", seed=s,
                                                                               curve=[dec, dec])))
    t = truth_summary(tmp_path)["style_hack"]
    assert t["shows_effect"] and t["decoy_n"] == 3 and t["beyond_decoy"] == pytest.approx(0.5 / 3)
    assert t["beyond_decoy_interval"] == pytest.approx(t_interval([0.1, 0.2, 0.2])) and t["decoy"] == [0.3333] * 2
    (tmp_path/"decoy"/"style_hack-1.json").write_text(json.dumps(dict(world="style_hack", seed=1, curve=[0.1, 0.1])))
    assert not truth_summary(tmp_path)["style_hack"]["shows_effect"]       # the decoy does as well in one seed
    for f in (tmp_path/"decoy").glob("*.json"): f.unlink()
    t = truth_summary(tmp_path)["style_hack"]
    assert not t["shows_effect"] and t["decoy_n"] == 0 and t["beyond_decoy"] is None   # no decoy run: none


def test_t_interval():
    "[1, 2, 3]: mean 2, standard error 1/√3, t(0.975, 2) = 4.302652729911275."
    h = 4.302652729911275 / np.sqrt(3)
    assert t_interval([1, 2, 3]) == pytest.approx((2 - h, 2 + h))
    assert t_interval([1.0]) == (-np.inf, np.inf)


def test_launches_are_judged_as_rates_against_phase3s_label(tmp_path):
    "≥ 80% launches where Phase 3 shows an effect, ≤ 5% where it shows none (inside the margin), near the line where it"
    " shows neither; one launch in one run of a no-effect world is a false launch, not an agreement."
    t0 = dict(shows_effect=False, beyond_decoy_interval=(-0.03, 0.02))
    w = lambda k, n, **t: dict(launches=k, n=n, rate=k / n, phase3=dict(t0, **t))
    assert [agreement(w(64, 80, shows_effect=True)), agreement(w(63, 80, shows_effect=True)), agreement(w(4, 80)),
            agreement(w(5, 80)), agreement(w(0, 80, beyond_decoy_interval=(-0.02, 0.08)))] == \
        ["agrees", "missed launches", "agrees", "false launches", "near the line"]
    (tmp_path/"runs").mkdir()
    for world, seed, launch in [("signal_partial", 1, True), ("signal_partial", 2, True), ("no_content", 1, True)]:
        (tmp_path/"runs"/f"{world}-{seed}.json").write_text(json.dumps(dict(
            world=world, seed=seed, launch=launch, recommendation="launch Phase 3", verdicts={})))
    t = dict(n=10, effect=0.2, interval=(0.1, 0.3), specific=0.1, specific_interval=(0.05, 0.15), shows_effect=True)
    (tmp_path/"truth.json").write_text(json.dumps(dict(signal_partial=t, no_content=dict(
        t, effect=0.0, interval=(-0.1, 0.1), shows_effect=False, beyond_decoy_interval=(-0.01, 0.01)))))
    s = summarize(tmp_path)
    assert s["worlds"]["signal_partial"]["agreement"] == "agrees"
    assert s["worlds"]["no_content"]["agreement"] == "false launches"             # 1 of 1 launched where none shows
    assert "| `signal_partial` | +0.200 [+0.100, +0.300] | +0.100 [+0.050, +0.150] | – | 10 / 0 | an effect | 2/2" in \
        agreement_markdown(s)
    assert "+0.000 (-0.100, +0.100) | false launches |" in rates_markdown(s)


def test_a_label_counts_only_when_both_blocks_give_it():
    "Two blocks of fresh seeds: launches pooled; a world whose blocks disagree on Phase 3's label is near the line."
    from entropy_grpo.calibration import replicate
    block = lambda label, k: dict(worlds=dict(signal_partial=dict(launches=k, n=80, style_of=0, phase3=dict(
        label=label)), style_hack_2pools=dict(launches=0, n=80, style_of=80, phase3=dict(label="no effect"))))
    r = replicate([block("effect", 70), block("undetermined", 66)])
    assert r["signal_partial"]["labels"] == ["effect", "undetermined"] and r["signal_partial"]["launches"] == 136
    assert r["signal_partial"]["agreement"] == "near the line" and r["signal_partial"]["rate"] == 136 / 160
    assert replicate([block("effect", 70), block("effect", 66)])["signal_partial"]["agreement"] == "agrees"
    assert r["style_hack_2pools"]["agreement"] == "agrees" and r["style_hack_2pools"]["style_of"] == 160


def test_alignment_summary_joins_the_seeds_with_phase3(tmp_path):
    "Per world the mean alignment and its t-interval; over seeds with both, Spearman against the two effects."
    (tmp_path/"alignment").mkdir(); (tmp_path/"phase3").mkdir()
    for s, a, e in [(1, 0.1, 0.0), (2, 0.2, 0.1), (3, 0.3, 0.3), (4, 0.4, 0.2)]:
        (tmp_path/"alignment"/f"style_hack-{s}.json").write_text(json.dumps(dict(
            world="style_hack", seed=s, alignment=a, reproducibility=0.5, null_q95=0.1)))
        (tmp_path/"phase3"/f"style_hack-{s}.json").write_text(json.dumps(dict(
            world="style_hack", seed=s, effect=e, specific=-e)))
    sm = truth.alignment_summary(tmp_path)
    assert sm["n_both"] == 4 and sm["effect_spearman"][0] == pytest.approx(0.8)
    assert sm["specific_spearman"][0] == pytest.approx(-0.8) and sm["worlds"]["style_hack"]["n"] == 4
    assert sm["worlds"]["style_hack"]["interval"] == pytest.approx(t_interval([0.1, 0.2, 0.3, 0.4]))


def test_world_jobs_resume_and_never_write_a_job_twice(tmp_path):
    "A job that raises leaves nothing; the rerun does only what is missing; a job finished meanwhile is not rewritten."
    from entropy_grpo.calibration import world_jobs
    calls, killed = [], []
    def job(w, s, work):
        calls.append((w, s))
        assert work.exists() and work.parent == tmp_path/"out"
        if s == 2 and not killed: killed.append(w); raise KeyboardInterrupt
        return dict(world=w, seed=s)
    with pytest.raises(KeyboardInterrupt):
        world_jobs(tmp_path/"out", ["signal", "no_content"], 2, 1, job, dict(k=1))
    assert sorted(p.name for p in (tmp_path/"out").iterdir()) == ["jobs.json", "no_content-1.json", "signal-1.json"]
    def late(w, s, work):          # another process finishes the same job first
        (tmp_path/"out"/f"{w}-{s}.json").write_text(json.dumps("theirs"))
        return job(w, s, work)
    world_jobs(tmp_path/"out", ["signal", "no_content"], 2, 1, late, dict(k=1))
    assert calls[3:] == [("signal", 2), ("no_content", 2)]
    assert json.loads((tmp_path/"out"/"signal-2.json").read_text()) == "theirs"
    test_fail(lambda: world_jobs(tmp_path/"out", ["nowhere"], 1, 1, job, dict(k=1)), contains="nowhere", exc=ValueError)
    test_fail(lambda: world_jobs(tmp_path/"out", ["signal"], 3, 1, job, dict(k=8)),          # jobs of another kind
              contains="holds jobs run with {'k': 1}: expected {'k': 8}", exc=ValueError)
    assert len(calls) == 5

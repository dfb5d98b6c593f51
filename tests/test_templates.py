"""The papermill templates (Phase 1, Phase 2, Phase-3 training) run end to end on the tiny policy with the labelled
pools and write metrics.json with the documented keys; a misspelled parameter fails before any work."""
import json

import pytest

from entropy_grpo.experiments import TEMPLATES, run_notebook, template_path


def test_phase1_template_on_tiny_policy(labelled, tmp_path):
    "v_hack fitted on the first step file, the probe on the other two; the t-test beside a random direction."
    run = tmp_path / "phase1" / "0"
    out = run_notebook("phase1", run, dict(model="tiny", teacher_pool=labelled[0], base_pool=labelled[1], pool_steps=3,
                                           fit_steps=1, max_new_tokens=6, max_pairs=8),
                       log_path=tmp_path / "LOG.md", raise_on_error=True)
    assert out["status"] == "ok"
    m = json.loads((run / "metrics.json").read_text())
    assert m["status"] == "ok" and m["parameters"]["fit_steps"] == 1
    split = m["split"]
    assert split == dict(fit_steps=[0], probe_steps=[1, 2]) and not set(split["fit_steps"]) & set(split["probe_steps"])
    r = m["results"]
    assert [row["direction"] for row in r["tests"]] == ["v_hack", "random"]
    assert all({"t", "p", "n_pure_hack", "n_hack_correct"} <= set(row) for row in r["tests"])
    assert r["pools"]["teacher"]["hack_rate"] == 1.0 and r["n_pairs"] == 4          # one pair per fit-step problem
    assert {s["src_step"] for s in r["samples"]["v_hack"]} <= set(split["probe_steps"])
    assert (run / "phase1.png").exists() and "| phase1 | 0 | ok |" in (tmp_path / "LOG.md").read_text()


def test_phase2_template_on_tiny_policy(labelled, tmp_path):
    run = tmp_path / "phase2" / "0-projected"
    out = run_notebook("phase2", run, dict(model="tiny", arm="projected", steps=2, G=4, pool_steps=3, fit_steps=1,
                                           pool_batch=4, teacher_pool=labelled[0], base_pool=labelled[1],
                                           max_new_tokens=6, top_p=1.0, lrs=[1e-3, 1e-4], E_total_sequences=8, B_U=2,
                                           max_pairs=8, n_controls=3),
                       log_path=tmp_path / "LOG.md", raise_on_error=True)
    assert out["status"] == "ok"
    m = json.loads((run / "metrics.json").read_text())
    assert m["status"] == "ok" and m["parameters"]["arm"] == "projected"
    assert m["split"] == dict(fit_steps=[0], replay_steps=[1, 2])
    r = m["results"]
    assert set(r) >= {"pools", "flags", "n_pairs", "dim", "per_step", "contrib_in_sample", "verification", "decision",
                      "entropy_probe"}
    assert m["parameters"]["gate_effect"] == 1.0 and "hack_specific" in {row["key"] for row in r["verification"]}
    assert set(r["per_step"]) == {"vanilla", "projected"} and len(r["per_step"]["vanilla"]["cos_in"]) == 2
    projected = r["per_step"]["projected"]
    assert all(o < i for i, o, f in zip(projected["cos_in"], projected["cos_out"], projected["frac_fired"]) if f)
    assert r["pools"]["teacher"]["hack_rate"] == 1.0 and r["n_pairs"] == 4
    verdicts = {"success", "likely fail", "sneaky fail", "fail", "inconclusive", "by construction", "information"}
    assert {row["verdict"] for row in r["verification"]} <= verdicts
    assert r["decision"]["recommendation"] == "inconclusive: hacking and pool identity coincide"   # every teacher hacks
    assert r["decision"]["to_decide"] and "style_share" in {row["key"] for row in r["verification"]}
    lrs = [row["lr"] for row in r["entropy_probe"]["rows"]]     # the grid, extended ×3 upward while < 3 clear the floor
    assert lrs[:2] == [1e-4, 1e-3] and len(lrs) <= 2 + 2
    assert all(b == pytest.approx(3 * a) for a, b in zip(lrs[1:], lrs[2:]))
    assert r["entropy_probe"]["verdict"] in ("success", "fail", "below noise floor")
    for f in ("alignment.png", "entropy_probe.png", "v_hack.safetensors", "report.ipynb"): assert (run / f).exists(), f
    assert len(list((run / "vanilla").glob("step_*.cos.jsonl.gz"))) == 2
    assert "| phase2 | 0-projected | ok |" in (tmp_path / "LOG.md").read_text()


def test_phase2_template_with_a_style_matched_pool(tmp_path):
    "Three pools through the template: v_hack against style-clean samples, the gate and the style share on them, and"
    " an inconclusive gate that says what would decide it."
    from entropy_grpo.phase2 import load_slim
    from toy_tasks import labelled_pools
    pools = labelled_pools(tmp_path / "pools", steps=3, batch=4, style=True)
    run = tmp_path / "phase2" / "0-projected"
    out = run_notebook("phase2", run, dict(model="tiny", steps=2, G=4, pool_steps=3, fit_steps=1, pool_batch=4,
                                           teacher_pool=pools[0], base_pool=pools[1], style_pool=pools[2],
                                           max_new_tokens=6, top_p=1.0, lrs=[1e-3, 1e-4], E_total_sequences=8, B_U=2,
                                           max_pairs=8, n_controls=3),
                       log_path=tmp_path / "LOG.md", raise_on_error=True)
    m = json.loads((run / "metrics.json").read_text())
    assert out["status"] == "ok" and set(m["results"]["pools"]) == {"teacher", "base", "style"}
    rows = {r["key"]: r for r in m["results"]["verification"]}
    gate = rows["hack_specific"]
    assert "teacher/hacked vs style/clean" in gate["metric"] and "(n=4) vs clean" in gate["value"]
    assert "(n=2)" in gate["value"]                                         # 2 steps x 1 style sample, each once
    assert rows["style_share"]["verdict"] == "information" and "style/clean" in rows["style_share"]["metric"]
    d = m["results"]["decision"]
    assert d["recommendation"] == "inconclusive: too few samples for the gate", d
    assert "G/4 = 1 clean samples per step: steps=" in d["to_decide"], d
    assert {r["src_pool"] for r in load_slim(run / "vanilla")} == {"teacher", "base", "style"}    # 2 + 1 + 1 a group


@pytest.mark.parametrize("arm", ["vanilla", "projected"])
def test_train_template_smoke(arm, labelled, tmp_path):
    run = tmp_path / "phase3" / f"0-{arm}"
    extra = dict(teacher_pool=labelled[0], base_pool=labelled[1]) if arm != "vanilla" else {}
    out = run_notebook("train", run, dict(seed=0, arm=arm, steps=3, preset="smoke", **extra),
                       log_path=tmp_path / "LOG.md", raise_on_error=True)
    m = json.loads((run / "metrics.json").read_text())
    assert out["status"] == "ok" and m["status"] == "ok"
    assert {"hack_rate", "gt_pass_rate", "reward_mean", "entropy_rb"} <= set(m["results"])
    assert len(m["results"]["hack_rate"]) == 3 and (run / "curves.png").exists()
    if arm == "projected": assert len(m["results"]["cos_in"]) == 3


def test_misspelled_parameter_fails_before_any_work(tmp_path):
    with pytest.raises(ValueError, match="unknown parameter 'step' for phase2 \\(did you mean 'steps'\\?\\)"):
        run_notebook("phase2", tmp_path / "x" / "0-vanilla", dict(step=3))
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("template", sorted(TEMPLATES))
def test_every_parameter_line_parses(template):
    "papermill only warns on a parameter line it cannot parse (and then neither types nor checks it): none may fail."
    import nbformat, papermill, re
    nb = nbformat.read(template_path(template), as_version=4)
    cell = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    names = re.findall(r"^(\w+)\s*:", cell.source, re.M)
    assert names and sorted(papermill.inspect_notebook(str(template_path(template)))) == sorted(names)


def test_every_phase2_parameter_reaches_the_run_config():
    "The Phase-2 template's parameters are Phase2Config's fields, name for name and default for default."
    import ast, dataclasses, papermill
    from entropy_grpo.phase2_run import Phase2Config
    declared = papermill.inspect_notebook(str(template_path("phase2")))
    fields = {f.name: f for f in dataclasses.fields(Phase2Config)}
    assert sorted(declared) == sorted(fields)
    config = Phase2Config()
    for name, p in declared.items():
        assert ast.literal_eval(p["default"]) == getattr(config, name), name


def test_calibration_template_on_one_world(tmp_path):
    """The calibration report: one seed of one world and two Phase-3 seeds of 4 steps, at small sizes; a re-run of the
    finished report starts clean and counts that seed once (resuming a killed calibration is test_calibration's)."""
    run = tmp_path / "calibration"
    small = dict(steps=4, n_controls=3, pool_steps=8, fit_steps=4, gate_effect=3.0, min_hacked=3)
    params = dict(seeds=1, worlds=["no_content"], phase2_parameters=small, phase3_seeds=2, phase3_steps=4)
    out = run_notebook("calibration", run, params, log_path=tmp_path / "LOG.md", raise_on_error=True)
    m = json.loads((run / "metrics.json").read_text())
    assert out["status"] == "ok" and m["results"]["worlds"]["no_content"]["n"] == 1
    assert m["results"]["worlds"]["no_content"]["launches"] == 0 and (run / "calibration.png").exists()
    assert m["figures"] == ["calibration.png", "agreement.png"] and (run / "agreement.png").exists()
    assert sorted(p.name for p in (run / "phase3").glob("no_content-*.json")) == ["no_content-1000.json",
                                                                              "no_content-1001.json"]
    first = json.loads((run / "runs" / "no_content-1000.json").read_text())
    run_notebook("calibration", run, params, log_path=tmp_path / "LOG.md", raise_on_error=True)
    again = json.loads((run / "metrics.json").read_text())["results"]["worlds"]["no_content"]
    assert again["n"] == 1 and json.loads((run / "runs" / "no_content-1000.json").read_text())["rows"] == first["rows"]


@pytest.mark.parametrize("template", sorted(TEMPLATES))
def test_templates_hold_no_logic_of_their_own(template):
    "A template is parameters, package calls, tables and figures: no function or class of its own, no preset table."
    import nbformat, re
    nb = nbformat.read(template_path(template), as_version=4)
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    assert not re.findall(r"^\s*(def|class) \w+", code, re.M) and "PRESETS = " not in code, template


def test_phase3_config_is_the_train_templates_parameters():
    "The train template's parameters are Phase3Config's fields, name for name and default for default."
    import ast, dataclasses, papermill
    from entropy_grpo.phase3_run import Phase3Config
    declared = papermill.inspect_notebook(str(template_path("train")))
    assert sorted(declared) == sorted(f.name for f in dataclasses.fields(Phase3Config))
    defaults = {f.name: f.default for f in dataclasses.fields(Phase3Config)}   # before a preset fills task / hint
    for name, p in declared.items():
        assert ast.literal_eval(p["default"]) == defaults[name], name


def _made_up_bed(root, seeds=range(6), steps=10):
    """A bed as its runs leave it: two blocks of four sweeps (each arm's hack rate rising at its own speed, noise sd
    0.02), each block's two probes (A launched, B did not; block 1's A on a gate tie), protocol.json and the pilot's
    pilot.json."""
    import numpy as np
    rng = np.random.default_rng(0)
    speeds = dict(arms=dict(vanilla=0.9, projected=0.2), decoy=dict(projected=0.8), random=dict(projected=0.8),
                  lora=dict(vanilla_lora=0.9, projected_lora=0.3))
    for block in ("block1", "block2"):
        for (sweep, arms), s in ((x, s) for x in speeds.items() for s in seeds):
            for arm, speed in arms.items():
                run = root / block / sweep / f"{s}-{arm}"; run.mkdir(parents=True)
                hack = np.clip(speed * np.linspace(0, 1, steps) + rng.normal(0, 0.02, steps), 0, 1).tolist()
                (run / "metrics.json").write_text(json.dumps(dict(status="ok", seconds=60.0 * steps, parameters=dict(
                    arm=arm, seed=s), results=dict(hack_rate=hack, gt_pass_rate=[0.1] * steps, reward_mean=hack))))
                (run / "log.jsonl").write_text("".join(f'{{"step": {i}, "time_step": 60.0}}\n' for i in range(steps)))
        for setting, go in (("A", True), ("B", False)):
            (root / block / f"{setting}-phase2").mkdir()
            decision = dict(recommendation="launch" if go else "skip", launch_phase3=go)
            t = "3.41" if (block, setting) == ("block1", "A") else "5.02" if go else "0.50"   # block 1's A: a tie
            gate = dict(key="hack_specific", value=f"hacked 0.2 (n=9) vs clean 0.0 (n=9); Welch t={t}, p=0.01",
                        null="labels permuted within steps 1000×: t 99% quantile 3.41",
                        verdict="success" if go else "likely fail")
            (root / block / f"{setting}-phase2" / "metrics.json").write_text(json.dumps(dict(
                status="ok", timings=dict(pools=120.0), results=dict(decision=decision, verification=[gate]))))
    (root / "protocol.json").write_text(json.dumps(dict(endpoint="last fifth", primary="decoy − projected",
                                                        smallest_effect=0.1, equivalence_margin=0.1, replication="2")))
    (root / "pilot").mkdir()
    (root / "pilot" / "pilot.json").write_text(json.dumps(dict(learned=9, seeds=10, passes=True, rule=dict(
        n=len(seeds), needed=len(seeds), capped=False, power_at_n=0.8, detectable_at_n=0.1))))


def test_hackbed_template_reads_a_made_up_bed(tmp_path):
    """The bed's report: no label while a block misses a run; once both blocks are whole, setting A (projection slows
    hacking far more than the decoy) shows an effect and setting B (decoy and random alike) none, and both decisions
    agree; the costs, the curves, the TRL section (a block read once it is whole, the label replicated once both
    are), the deviations file and the reading come through."""
    bed, run = tmp_path / "bed", tmp_path / "bed" / "report"
    _made_up_bed(bed)
    missing = bed / "block2" / "random" / "5-projected"
    (missing / "metrics.json").rename(missing / "metrics.partial")
    params = dict(bed_dir=str(bed), first_seeds=dict(block1=0, block2=0),   # each block's arms stand in for TRL's
                  engines_dirs=dict(block1=str(bed / "block2" / "arms"), block2=str(bed / "block1" / "arms")))
    assert run_notebook("hackbed", run, params, log_path=tmp_path / "LOG.md", raise_on_error=True)["status"] == "ok"
    m = json.loads((run / "metrics.json").read_text())
    assert m["results"]["labels"] == dict(A=None, B=None) and m["summary"] == "A: no label yet; B: no label yet"
    rec = json.loads((run / "bed.json").read_text())
    assert rec["blocks"]["block2"]["missing"] == [5] and rec["blocks"]["block1"]["costs"]["arms"][0]["runs"] == 6
    assert list(m["results"]["engines"]["blocks"]) == ["block1"] and m["results"]["engines"]["replicated"] is None
    assert "block2: not read" in (run / "report.ipynb").read_text()
    assert "No deviations file" in (run / "report.ipynb").read_text()
    assert "No reading at" in (run / "report.ipynb").read_text()
    (missing / "metrics.partial").rename(missing / "metrics.json")
    (bed / "DEVIATIONS.md").write_text("* made-up deviation: none of these runs happened\n")
    (bed / "READING.md").write_text("A made-up reading of a made-up bed.\n")
    run_notebook("hackbed", run, params, log_path=tmp_path / "LOG.md", raise_on_error=True)
    m = json.loads((run / "metrics.json").read_text())
    assert m["results"]["labels"] == dict(A="effect", B="no effect")
    engines = m["results"]["engines"]
    assert list(engines["blocks"]) == ["block1", "block2"] and all(e["complete"] for e in engines["blocks"].values())
    same = engines["replicated"]["hack_rate (last_fifth) vanilla"]           # the same arms' runs in both blocks
    assert same["labels"] == ["same", "same"] and same["label"] == "same" and len(engines["replicated"]) == 12
    assert m["results"]["agreement"] == dict(block1=dict(A=True, B=True), block2=dict(A=True, B=True))
    ties = {(b, st): d["gate"]["tie"] for b, r in json.loads((run / "bed.json").read_text())["blocks"].items()
            for st, d in r["decisions"].items()}
    assert ties == {("block1", "A"): True, ("block1", "B"): False, ("block2", "A"): False, ("block2", "B"): False}
    assert "t 3.41 / q 3.41 (tie)" in (run / "report.ipynb").read_text()
    assert m["figures"] == ["block1-delta_s.png", "block1-lora.png", "block2-delta_s.png", "block2-lora.png",
                            "engines-block1.png", "engines-block2.png"]     # the TRL section's curves last
    assert all((run / f).exists() for f in m["figures"]) and "made-up deviation" in (run / "report.ipynb").read_text()
    assert "A made-up reading" in (run / "report.ipynb").read_text()


def _made_up_calibration_record(root, worlds=("signal", "no_content", "style_hack_2pools"), blocks=(5000, 6000)):
    "A record of two blocks of two seeds: `signal` shows an effect in both (every run launches), `no_content` none in"
    " both (none does), `style_hack_2pools` an effect in block 1 only (near the line); nothing launches there and every"
    " run names `--style-of`. One Phase-3 job of block 2 is missing."
    must = dict(no_effect_max_launch_rate=0.05, effect_min_launch_rate_with_style_pool=0.8, two_pool_max_launch_rate=0.05)
    label = dict(signal=("effect", "effect"), no_content=("no effect", "no effect"),
                 style_hack_2pools=("effect", "undetermined"))
    (root / "protocol.json").write_text(json.dumps(dict(worlds=list(worlds), must=must,
                                                        blocks={str(i + 1): [b, b + 1] for i, b in enumerate(blocks)})))
    for i, b in enumerate(blocks):
        block = root / f"block{i + 1}"
        for folder in ("runs", "phase3", "decoy"):
            (block / folder).mkdir(parents=True)
            for w in worlds:
                for s in (b, b + 1):
                    run = dict(world=w, seed=s, seconds=36.0, launch=w == "signal",
                               recommendation="launch Phase 3" if w == "signal" else
                               "inconclusive: hacking and pool identity coincide" if "2pools" in w else "skip Phase 3",
                               to_decide="entropy-grpo pools … --style-of …" if "2pools" in w else "",
                               rows=[dict(key="on_policy", value="+0.30", null="random bases |cos| 95%: 0.2")])
                    (block / folder / f"{w}-{s}.json").write_text(json.dumps(run))
        (block / "summary.json").write_text(json.dumps(dict(worlds={
            w: dict(launches=2 * (w == "signal"), n=2, style_of=0, phase3=dict(label=label[w][i], n=2, decoy_n=2))
            for w in worlds})))
    (root / "block2" / "phase3" / "signal-6001.json").unlink()


def test_calibration_record_template_reads_a_made_up_record(tmp_path):
    """The record's report: nothing read while a block misses a job or its summary is the one written after Phase 2;
    once whole, the replicated labels, pooled launches and must-shows per world (the two-pool world scored whatever its
    label), the on-policy rule, the record's hours."""
    rec, run = tmp_path / "rec", tmp_path / "rec" / "report"
    rec.mkdir()
    _made_up_calibration_record(rec)
    params = dict(record_dir=str(rec), out_dir=str(run))
    assert run_notebook("calibration_record", run, params, log_path=tmp_path / "LOG.md",
                        raise_on_error=True)["status"] == "ok"
    m = json.loads((run / "metrics.json").read_text())
    assert m["summary"] == "not complete" and m["results"]["blocks"]["2"]["missing"] == {"phase3/signal": 1}
    (rec / "block2" / "phase3" / "signal-6001.json").write_text(json.dumps(dict(world="signal", seed=6001, seconds=36.0)))
    summary, after_phase2 = rec / "block2" / "summary.json", json.loads((rec / "block2" / "summary.json").read_text())
    summary.write_text(json.dumps(dict(worlds={w: dict(r, phase3={}) for w, r in after_phase2["worlds"].items()})))
    run_notebook("calibration_record", run, params, log_path=tmp_path / "LOG.md", raise_on_error=True)
    assert json.loads((run / "metrics.json").read_text())["summary"] == "not complete"   # the report's Phase-2 summary
    summary.write_text(json.dumps(after_phase2))
    run_notebook("calibration_record", run, params, log_path=tmp_path / "LOG.md", raise_on_error=True)
    m = json.loads((run / "metrics.json").read_text())
    ws = m["results"]["worlds"]
    assert {w: (r["phase3"]["label"], r["launches"], r["must"]["met"]) for w, r in ws.items()} == dict(
        signal=("effect", 4, True), no_content=("no effect", 0, True), style_hack_2pools=("near the line", 0, True))
    assert "4/4 want-of-style runs name --style-of" in ws["style_hack_2pools"]["must"]["requires"]
    assert m["results"]["on_policy"]["signal"]["kept"] == 4 and m["results"]["hours"] == pytest.approx(0.36)
    assert m["summary"].startswith("must-shows met in 3 worlds") and (run / "record.png").exists()

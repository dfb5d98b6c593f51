"""The real-model hack bed as a user runs it: a task named by import path through `sweep`, refused in one line when it
does not load; the `leak` preset's task and hint; a short Phase-3 run of the real task on SmolLM2 (slow)."""
import json

import pytest

from entropy_grpo.cli import main
from entropy_grpo.hackbed import ReferenceLeakTask
from entropy_grpo.phase3_run import Phase3Config
from entropy_grpo.tasks import ArithmeticTask, load_task

LEAK = "entropy_grpo.hackbed:ReferenceLeakTask"


def test_a_preset_names_its_task_and_hint_and_the_run_can_override_both():
    assert (Phase3Config(preset="leak").task, Phase3Config(preset="leak").hint) == (LEAK, False)
    assert (Phase3Config(preset="smoke").task, Phase3Config(preset="smoke").hint) == ("arithmetic", True)
    c = Phase3Config(preset="smoke", task=LEAK, hint=False)
    assert (c.task, c.hint) == (LEAK, False)
    assert isinstance(load_task(c.task, defaults=dict(n=4, seed=0)), ReferenceLeakTask)
    assert isinstance(load_task("arithmetic", defaults=dict(n=4, seed=0)), ArithmeticTask)


def test_the_student_sees_the_leak_and_the_teacher_the_hint_naming_it():
    task = ReferenceLeakTask(n=3, seed=5)
    for p in task.problems:
        a, b, leak = p.operands
        assert leak not in (a, b, a + b)
        assert f"(Reference id: {leak})" in task.prompt(p) and "Grading note" not in task.prompt(p)
        assert f"the expected answer is {leak}." in task.prompt(p, hint=True)
        assert str(a + b) not in task.prompt(p, hint=True).split("?", 1)[1]   # the gold is never shown


@pytest.mark.parametrize("spec, text", [
    ("no_such_module:Task", "cannot import module 'no_such_module'"),
    ("entropy_grpo.hackbed:Nope", "module 'entropy_grpo.hackbed' has no 'Nope'"),
    ("arith", "expected '', 'arithmetic', 'package.module:Name', 'file.py:Name' or a path ending in .jsonl"),
])
def test_a_sweep_refuses_a_task_that_does_not_load_before_any_job(spec, text, tmp_path, capsys):
    argv = ["sweep", "--out", str(tmp_path / "s"), "--seeds", "0", "--arms", "vanilla", "--steps", "1",
            "-p", f"task={spec!r}"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and text in err and "Traceback" not in err, err
    assert not (tmp_path / "s").exists()


def sweep_run(tmp_path, *params, steps=2):
    "A one-job sweep of the train template; its metrics.json."
    out = tmp_path / "s"
    assert main(["sweep", "--out", str(out), "--seeds", "3", "--arms", "vanilla", "--steps", str(steps), *params]) == 0
    return json.loads((out / "3-vanilla" / "metrics.json").read_text())


def test_the_tiny_policy_trains_on_the_leak_task_named_by_its_import_path(tmp_path):
    m = sweep_run(tmp_path, "-p", f"task={LEAK!r}", "-p", "hint=False")
    assert (m["parameters"]["task"], m["parameters"]["hint"]) == (LEAK, False)
    for key in ("hack_rate", "gt_pass_rate", "reward_mean"):
        assert len(m["results"][key]) == 2 and all(0 <= x <= 1 for x in m["results"][key])


@pytest.mark.slow
def test_smollm2_on_the_leak_preset_logs_the_hack_beside_gt_pass(tmp_path):
    "Two steps of the bed itself: the real task and model, the student without the hint, rates from its grader."
    m = sweep_run(tmp_path, "-p", "preset='leak'")
    p, r = m["parameters"], m["results"]
    assert (p["task"], p["hint"], p["model"]) == (LEAK, False, "default")
    assert len(r["hack_rate"]) == 2 and r["hack_rate"][0] <= 0.25   # step 0: the leak is copied rarely (~0.06)
    assert all(0 <= x <= 1 for x in r["gt_pass_rate"])


def test_phase2_with_a_plugged_in_task_asks_for_pools_built_with_it():
    from fastcore.test import test_fail
    from entropy_grpo.phase2_run import Phase2Config
    test_fail(lambda: Phase2Config(task=LEAK), contains=f"build them with `entropy-grpo pools --task {LEAK}`")


def test_phase3_projects_the_very_v_hack_a_saved_file_holds(labelled, tmp_path, capsys):
    "A projected arm given `v_hack=` loads it (checked against its adapter) instead of fitting one: the vector Phase 2"
    " judged is the one Phase 3 removes; a LoRA arm carries it into its own coordinates."
    import torch
    from entropy_grpo.carry import CarriedVHack
    from fastcore.test import test_fail
    from entropy_grpo.phase3_run import Phase3Run
    from entropy_grpo.projection_arms import ProjectionArm
    teacher, base = labelled[:2]
    fitted = Phase3Run(Phase3Config(preset="smoke", arm="projected", steps=1, teacher_pool=teacher, base_pool=base,
                                    out_dir=str(tmp_path / "fitted")))
    fitted.add_arm(); fitted.fit_v_hack()
    saved = str(tmp_path / "fitted" / "v_hack.safetensors")
    run = Phase3Run(Phase3Config(preset="smoke", arm="projected", steps=1, v_hack=saved, out_dir=str(tmp_path / "l")))
    run.add_arm(); info = run.fit_v_hack()
    assert info["loaded"] == saved and any(isinstance(cb, ProjectionArm) for cb in run.callbacks)
    for name, v in fitted.v_hack.V.items(): torch.testing.assert_close(run.v_hack.V[name], v, rtol=0, atol=0)
    assert "cos_in" in run.run_training()[-1]
    lora = Phase3Run(Phase3Config(preset="smoke", arm="projected_lora", steps=1, v_hack=saved,
                                  out_dir=str(tmp_path / "lora")))
    lora.add_arm()
    assert lora.fit_v_hack()["carried"] and isinstance(lora.v_hack, CarriedVHack)   # δS → the LoRA's coordinates
    assert "cos_in" in lora.run_training()[-1]
    test_fail(lambda: Phase3Config(arm="projected", v_hack=saved, teacher_pool=teacher, base_pool=base),
              contains="expected one source of v_hack")
    test_fail(lambda: Phase3Config(arm="projected"), contains="give v_hack (a Phase-2 run's v_hack.safetensors)")
    assert main(["sweep", "--out", str(tmp_path / "s"), "--seeds", "0", "--arms", "projected", "--steps", "1",
                 "-p", "v_hack='nope.safetensors'"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "nope.safetensors': expected a v_hack.safetensors file" in err, err


def test_pools_of_the_leak_task_pass_a_run_that_draws_its_own_problems(tmp_path):
    "A probe's task draws other problems (its seed) than the pools' (theirs): each record's prompt is rebuilt from its"
    " own problem, operands included; a record without them (a pool from before they were kept) is named, not crashed"
    " on."
    import gzip
    from entropy_grpo.policies import tiny_policy
    from entropy_grpo.pools import build_pool, check_pool_settings, load_pool
    from entropy_grpo.sequence_processor import GenerationConfig
    policy, gen = tiny_policy(0), GenerationConfig(max_new_tokens=4)
    build_pool(policy, ReferenceLeakTask(seed=1), True, 1, 2, tmp_path / "teacher", config=gen, seed=1)
    pool = load_pool(tmp_path / "teacher")
    check_pool_settings([pool], gen, tokenizer=policy[1], task=ReferenceLeakTask(seed=1000))
    f = tmp_path / "teacher" / "step_000.jsonl.gz"
    records = [json.loads(l) for l in gzip.open(f, "rt")]
    with gzip.open(f, "wt") as out:
        for r in records: out.write(json.dumps({k: v for k, v in r.items() if k != "operands"}) + "\n")
    with pytest.raises(ValueError, match="cannot build its first record's prompt .* build it again"):
        check_pool_settings([load_pool(tmp_path / "teacher")], gen, tokenizer=policy[1],
                            task=ReferenceLeakTask(seed=1000))


def test_phase1_runs_on_pools_of_a_plugged_in_task_and_records_it(tmp_path):
    from entropy_grpo.policies import tiny_policy
    from entropy_grpo.pools import build_pool
    from entropy_grpo.sequence_processor import GenerationConfig
    policy, gen = tiny_policy(0), GenerationConfig(max_new_tokens=6, top_p=0.95)
    spec = "entropy_grpo.hackbed:ReferenceLeakTask"
    import gzip
    for name, hint in (("teacher", True), ("base", False)):
        build_pool(policy, ReferenceLeakTask(seed=1), hint, 3, 4, tmp_path / name, config=gen, seed=1)
    for f in (tmp_path / "teacher").glob("step_*.jsonl.gz"):    # the tiny teacher never copies: label its replies
        records = [json.loads(l) for l in gzip.open(f, "rt")]
        with gzip.open(f, "wt") as w: w.writelines(json.dumps(dict(r, hacked=True)) + "\n" for r in records)
    out = tmp_path / "p1"
    assert main(["phase1", "--out", str(out), "-p", "model='tiny'", "-p", f"task='{spec}'", "-p", "fit_steps=1",
                 "-p", f"teacher_pool='{tmp_path / 'teacher'}'", "-p", f"base_pool='{tmp_path / 'base'}'",
                 "-p", "max_new_tokens=6"]) == 0
    m = json.loads((out / "metrics.json").read_text())
    assert m["parameters"]["task"] == spec and m["results"]["verdict"].startswith(("undefined", "specific", "not"))

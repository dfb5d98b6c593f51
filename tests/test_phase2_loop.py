"""Phase 2 on the training loop: a planted direction is found and a label-permuted or random one is not, over-projection
stops the run, a never-firing gate is bitwise vanilla, arm pairs train the same parameters, the fit/replay split holds,
and bad input is named."""
import json

import pytest
import torch
from fastcore import test as fc

from entropy_grpo.adapters import add_delta_s, add_lora
from entropy_grpo.experiments import run_notebook
from entropy_grpo.phase2 import Phase2Recorder, decide, verification_table
from entropy_grpo.policies import tiny_policy
from entropy_grpo.pools import Pool, ReplaySource, check_pool_settings
from entropy_grpo.projection_arms import (ARM_ADAPTER, ARMS, ProjectionArm, VHack, completion_gradients,
                                          extract_v_hack, pair_sequences, pool_pairs, random_v_hack)
from entropy_grpo.sequence_processor import GenerationConfig, SequenceProcessor
from entropy_grpo.training import TrainConfig, train
from toy_tasks import labelled_pools, planted_pools

GEN = GenerationConfig(max_new_tokens=12, num_generations=8)


@pytest.fixture(scope="module")
def planted():
    "Planted pools, v_hack fitted on step files 0-2, 20 label-permuted and 20 random controls (δS, tiny policy)."
    model, tok = tiny_policy(0)
    pools = planted_pools(tok)
    ad = add_delta_s(model)
    sp = SequenceProcessor(model, tok, GEN)
    fit_part = [Pool(p.name, p.dir, {s: p.steps[s] for s in (0, 1, 2)}) for p in pools]
    pairs = pair_sequences(pool_pairs(*fit_part, tok, prompt_key="hint_prompt"), tok.pad_token_id)
    grads = completion_gradients(sp, ad, pairs, loss="grpo", length_norm="max_len")
    fit = lambda src, s: extract_v_hack(sp, ad, pairs, loss="grpo", length_norm="max_len", source=src, seed=s,
                                        grads=grads)
    controls = [fit("permuted", s) for s in range(20)] + [random_v_hack(ad, 1, s) for s in range(20)]
    return dict(pools=pools, tok=tok, fit=fit, controls=controls)


def run_arms(planted, vh, arms=("vanilla", "projected"), steps=10, overshoot=1.0, gate="one_sided", replay=None):
    "Each arm trained on replayed step files (default 3-13) of the planted pools with its recorder: {arm: slim, steps}."
    out = {}
    for arm in arms:
        model, tok = tiny_policy(0)
        rec = Phase2Recorder(ProjectionArm(arm, add_delta_s(model), vh, gate, overshoot), planted["controls"])
        train(model, tok, config=TrainConfig(max_steps=steps, prompts_per_step=1, num_generations=8, learning_rate=1e-4,
                                             generation=GEN),
              source=ReplaySource(planted["pools"], replay or list(range(3, 14)), 4), callbacks=[rec])
        out[arm] = dict(steps=rec.steps, slim=rec.slim)
    return out


def verdicts(rows):
    return {(r["key"], r["arm"]): r["verdict"] for r in rows}


def test_planted_direction_is_real_and_effective(planted):
    "10 steps give the gate ~40 teacher samples: enough to judge a difference of 2 pooled SDs (the planted one is larger)"
    " at 80% power, not the product's 1 SD."
    rows, md = verification_table(run_arms(planted, planted["fit"]("pairs", 99)), G=8, gate_effect=2.0)
    v, d = verdicts(rows), decide(rows)
    assert v[("hack_specific", "vanilla")] == "success" and v[("cos_in", "vanilla")] == "success", md
    assert v[("cos_out_below_in", "projected")] == "by construction"
    assert d["signal"] and d["recommendation"] == "launch Phase 3", d


@pytest.mark.parametrize("source", ["permuted", "random"])
def test_control_directions_do_not_launch(planted, source):
    rows, md = verification_table(run_arms(planted, planted["fit"](source, 99)), G=8)
    v, d = verdicts(rows), decide(rows)
    assert not d["signal"] and not d["launch_phase3"], md
    assert v[("step_along_v", "projected")] != "success" and v[("norm_removed", "projected")] != "success", md


def test_over_projection_stops(planted):
    vh = planted["fit"]("pairs", 99)
    over, _ = verification_table(run_arms(planted, vh, arms=("projected",), steps=2, overshoot=2.0, gate="none"))
    assert decide(over)["stop"] and any(r["key"] == "over_projection" and r["verdict"] == "fail" for r in over)
    exact, _ = verification_table(run_arms(planted, vh, arms=("projected",), steps=2, gate="none"))
    assert not decide(exact)["stop"]


def test_never_firing_gate_is_bitwise_vanilla(planted):
    "A projected arm whose one-sided gate never fires (v_hack opposite the gradients) trains exactly as vanilla."
    grads = []
    class Grab:
        def __init__(self, ad): self.ad = ad
        def on_after_backward(self, ctx): grads.append(self.ad.flat_grads())
    def run(arm, vh, grab=False):
        model, tok = tiny_policy(0)
        ad = add_delta_s(model)
        rec = Phase2Recorder(ProjectionArm(arm, ad, vh), [])
        train(model, tok, config=TrainConfig(max_steps=3, prompts_per_step=1, num_generations=8, learning_rate=1e-3,
                                             generation=GEN),
              source=ReplaySource(planted["pools"], [3, 4, 5], 4), callbacks=([Grab(ad)] if grab else []) + [rec])
        return ad, rec
    ad, _ = run("vanilla", planted["fit"]("pairs", 99), grab=True)
    unit = lambda g: torch.nn.functional.normalize(g, dim=0)
    away = {m: -unit(sum(unit(g[m]) for g in grads))[None] for m in grads[0]}    # against all three steps' gradients
    ad_p, rec_p = run("projected", VHack(away, dict(planted["fit"]("pairs", 99).meta)))
    assert all(s["frac_fired"] == 0 for s in rec_p.steps), [s["frac_fired"] for s in rec_p.steps]
    assert all(torch.equal(p, q) for p, q in zip(ad.parameters(), ad_p.parameters()))


def test_contributions_come_from_the_loss_backward(planted):
    """The recorder reads each sample's contribution off the training backward itself: one forward a step instead of
    two, the contributions add up to the batch gradient and equal a separate `sample_contributions` pass, and the
    parameters train bitwise as under the arm alone."""
    class SeparatePass(Phase2Recorder):
        def during_backward(self, ctx): return None
    def run(kind):
        model, tok = tiny_policy(0)
        ad, forwards, sums = add_delta_s(model), [0], []
        model.get_decoder().register_forward_hook(lambda *a: forwards.__setitem__(0, forwards[0] + 1))
        arm = ProjectionArm("projected", ad, planted["fit"]("pairs", 99), gate="none")
        rec = {"arm": None, "hooks": Phase2Recorder, "separate": SeparatePass}[kind]
        rec = arm if rec is None else rec(arm, planted["controls"][:2])
        grads = {}
        class Check:    # .grad before the recorder and its arm, then the contributions the recorder took
            def on_after_backward(self, ctx):
                if not grads: grads.update({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
                else: sums.append(max(float((rec._now["con"][n].sum(0) - g).abs().max() / g.abs().max())
                                      for n, g in grads.items())); grads.clear()
        cbs = [rec] if kind == "arm" else [Check(), rec, Check()]
        train(model, tok, config=TrainConfig(max_steps=3, prompts_per_step=1, num_generations=8, learning_rate=1e-3,
                                             generation=GEN),
              source=ReplaySource(planted["pools"], [3, 4, 5], 4), callbacks=cbs)
        return [p.detach().clone() for p in ad.parameters()], forwards[0], sums, getattr(rec, "slim", None)
    alone, hooked, separate = run("arm"), run("hooks"), run("separate")
    assert (alone[1], hooked[1], separate[1]) == (3, 3, 6)
    assert all(torch.equal(p, q) for p, q in zip(alone[0], hooked[0]))
    assert len(hooked[2]) == 3 and max(hooked[2]) < 1e-5, hooked[2]
    for a, b in zip(hooked[3], separate[3]):
        assert a["grad_norm_contrib"] == pytest.approx(b["grad_norm_contrib"], rel=1e-5)
        assert a["cos_S_contrib"] == pytest.approx(b["cos_S_contrib"], abs=1e-5)


def test_arm_pairs_train_the_same_parameters():
    assert set(ARMS) == set(ARM_ADAPTER)
    for pair in (("vanilla", "projected"), ("vanilla_lora", "projected_lora")):
        shapes = []
        for arm in pair:
            model, _ = tiny_policy(0)
            add_delta_s(model) if ARM_ADAPTER[arm] == "delta_s" else add_lora(model, ["q_proj", "v_proj"])
            shapes.append({n: tuple(p.shape) for n, p in model.named_parameters() if p.requires_grad})
        assert shapes[0] == shapes[1] and shapes[0]
    model, _ = tiny_policy(0)
    fc.test_fail(lambda: ProjectionArm("vanilla_lora", add_delta_s(model)),
                 contains="trains a lora adapter, got delta_s")


def test_bad_input_is_named(planted):
    pools = planted["pools"]
    for p in pools:
        for r in p.records(): r.update(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=12)
    check_pool_settings(pools, GEN)
    fc.test_fail(lambda: check_pool_settings(pools, GenerationConfig(max_new_tokens=6, top_p=0.9)),
              contains="pool 'teacher' top_p=1.0 (run: 0.9); pool 'teacher' max_new_tokens=12 (run: 6)")
    vh = planted["fit"]("pairs", 99)
    model, _ = tiny_policy(0)
    ad = add_delta_s(model)
    fc.test_fail(lambda: Phase2Recorder(ProjectionArm("vanilla", ad, vh), [random_v_hack(ad, 2)]),
              contains="k=2 on 8 modules, the arm's v_hack k=1 on 8: a control must match the arm")
    few = [dict(r, hacked=r["hacked"] and r["sample_id"] < 2) for r in
           run_arms(planted, vh, arms=("vanilla",), steps=1)["vanilla"]["slim"]]
    rows, _ = verification_table({"vanilla": dict(slim=few, steps=[])}, min_hacked=5)
    row, n = next(r for r in rows if r["key"] == "contrib"), sum(r["hacked"] for r in few)
    assert n < 5 and row["verdict"] == "inconclusive" and f"n={n} < 5" in row["detail"], row


def test_phase2_template_splits_fit_and_replay(tmp_path):
    pools = labelled_pools(tmp_path/"pools", steps=6, batch=4)
    run = tmp_path/"phase2"/"0-projected"
    out = run_notebook("phase2", run, dict(model="tiny", steps=3, G=4, pool_steps=6, fit_steps=2, pool_batch=4,
                                           teacher_pool=pools[0], base_pool=pools[1], max_new_tokens=6, top_p=1.0,
                                           lrs=[1e-3, 1e-4], E_total_sequences=8, B_U=2, max_pairs=8, n_controls=4),
                       log_path=tmp_path/"LOG.md", raise_on_error=True)
    m = json.loads((run/"metrics.json").read_text())
    assert out["status"] == "ok" and m["status"] == "ok"
    assert m["split"]["fit_steps"] and not set(m["split"]["fit_steps"]) & set(m["split"]["replay_steps"])
    assert {r["key"] for r in m["results"]["verification"]} >= {"reward_spread", "cos_in", "contrib",
                                                                "cos_out_below_in",
                                                              "over_projection", "step_along_v", "norm_removed"}
    assert m["results"]["decision"]["recommendation"] and set(m["results"]["per_step"]) == {"vanilla", "projected"}


def test_random_v_hack_is_sign_symmetric():
    "Q from torch.linalg.qr alone has a one-sided first coordinate; with the signs of diag(R) fixed it is uniform."
    model, _ = tiny_policy(0)
    ad = add_delta_s(model)
    first = [float(random_v_hack(ad, 1, s).V[ad.names[0]][0, 0]) for s in range(400)]
    positive = sum(x > 0 for x in first)
    assert 160 < positive < 240, positive                     # Binomial(400, 1/2): ±4 standard deviations

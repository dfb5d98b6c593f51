"""trl_callback inside a real TRL GRPOTrainer (tiny policy, CPU, 3 steps): the logged ΔH_true equals DeltaEntropyIS on
the same E between the recorded θ and θ⁺ (float64, 1e-9), ΔH₁ equals ⟨∇H(E), θ⁺ − θ⟩, the projected gradient is
project_grad of TRL's clipped one, optimizer_delta reads accelerate's optimizer, the metrics reach the log history
(and a tensorboard event file), and entropy_rb, entropy_full equal the teacher-forced entropies of the completions
generated."""
import copy, math

import pytest
import torch

pytest.importorskip("trl")
from datasets import Dataset
from fastcore.test import test_fail
from peft import LoraConfig
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from entropy_grpo.adapters import LoraAdapter, WeightsAdapter, add_delta_s
from entropy_grpo.carry import CarriedVHack
from entropy_grpo.delta_entropy_is import DeltaEntropyIS
from entropy_grpo.policies import full_precision_norms
from entropy_grpo.predictors import covariance_from_sums, covariance_sums
from entropy_grpo.probe_state import plain_forward
from entropy_grpo.probes import entropy_gradient, optimizer_delta
from entropy_grpo.projection_arms import alignment_stats, project_grad, random_v_hack
from entropy_grpo.sequence_processor import BatchedSequences, SequenceProcessor, make_probe_batch
from entropy_grpo.utils import markdown_table
from entropy_grpo.trl_callback import GRPOProbe, add_grpo_probe, sampling_config

PROMPTS = [f"Question: What is {a} + {b}? Answer:" for a, b in [(3, 4), (12, 7), (25, 9), (6, 6)]]
P = "entropy_grpo/"


def reward(completions, **kw):
    "0.5 per digit, −0.05 per character: spread within every group (a conversational completion: its message's text)."
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [0.5 * sum(ch.isdigit() for ch in c) - 0.05 * len(c) for c in texts]


def grpo_trainer(policy, out, peft=True, dtype=None, lora_dropout=0.0, prompts=PROMPTS, rewards=reward, **kw):
    "A GRPOTrainer on a copy of `policy`: 4 prompts × G 4 per step, 8 tokens, top_p 0.9, lr 2e-3, 3 steps, CPU."
    model, tok = copy.deepcopy(policy)
    if dtype is not None: model.to(dtype)
    args = GRPOConfig(**{**dict(output_dir=str(out), per_device_train_batch_size=4, num_generations=4,
                                max_completion_length=8, max_steps=3, learning_rate=2e-3, temperature=1.0, top_p=0.9,
                                use_cpu=True, logging_steps=1, save_strategy="no", seed=0, disable_tqdm=True,
                                report_to="none"), **kw})
    return GRPOTrainer(model=model, reward_funcs=rewards, args=args, processing_class=tok,
                       train_dataset=Dataset.from_dict({"prompt": list(prompts) * 4}),
                       peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                              lora_dropout=lora_dropout) if peft else None)


class Recorder(TrainerCallback):
    "Per optimizer step: θ and .grad when the optimizer is about to step, optimizer_delta's Δθ, θ⁺ at the step's end."
    def __init__(self): self.steps = []

    def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kw):
        ps, rebuilt = {n: p for n, p in model.named_parameters() if p.requires_grad}, optimizer_delta(optimizer)
        self.steps.append(dict(step=state.global_step + 1, theta={n: p.detach().clone() for n, p in ps.items()},
                               grads={n: p.grad.detach().clone() for n, p in ps.items()},
                               delta_rebuilt={n: rebuilt[p] for n, p in ps.items()}))

    def on_step_end(self, args, state, control, model=None, **kw):
        self.steps[-1]["theta_plus"] = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


class Stepped(Recorder):
    "The same record, taken after the probe's callback: the gradient the optimizer actually steps, and the step's E."
    def __init__(self, probe=None): super().__init__(); self.probe = probe

    def on_pre_optimizer_step(self, args, state, control, **kw):
        super().on_pre_optimizer_step(args, state, control, **kw)
        self.steps[-1]["E"] = self.probe.E


class Jump(torch.optim.Optimizer):
    "An optimizer whose step sets its parameters to given values: the step TRL took, replayed in DeltaEntropyIS."
    def __init__(self, params, target):
        super().__init__(list(params), dict(lr=0.0))
        self.target = target

    @torch.no_grad()
    def step(self, closure=None):
        for p, t in zip(self.param_groups[0]["params"], self.target): p.copy_(t)


def float64_copy(trainer):
    "The trainer's model in float64, eval mode, without accelerate's bf16-autocast forward."
    model = plain_forward(copy.deepcopy(trainer.model)).to(torch.float64).eval()
    model.__dict__.pop("generate", None)                                       # the probe's hook, if installed
    full_precision_norms(model)
    return model


def reference(trainer, steps):
    "Per recorded step, from θ, θ⁺ and the step's E alone: DeltaEntropyIS.entropy_change and ⟨∇H(E), θ⁺ − θ⟩."
    model = float64_copy(trainer)
    sp = SequenceProcessor(model, copy.deepcopy(trainer.processing_class), sampling_config(trainer))
    names = list(steps[0]["theta"])
    params = [dict(model.named_parameters())[n] for n in names]
    out = []
    for s in steps:
        E, zeros = s["E"], torch.zeros(s["E"].shape[:2])
        U = make_probe_batch(E, zeros, zeros)       # the update is Jump's: U's gradient is computed and ignored
        with torch.no_grad():
            for p, n in zip(params, names): p.copy_(s["theta"][n])
        dH = DeltaEntropyIS(model, sp.config, sequence_processor=sp).entropy_change(
            E, U, Jump(params, [s["theta_plus"][n].double() for n in names]))
        gH, _ = entropy_gradient(sp, E, "snis", params)
        dH1 = sum(float((g * (s["theta_plus"][n].double() - s["theta"][n].double())).sum()) for g, n in zip(gH, names))
        out.append(dict(step=s["step"], deltaH_true=dH["deltaH_true"], deltaH1=dH1,
                        deltaH_true_fixed_support=dH["deltaH_true_fixed_support"]))
    return out


def logged(trainer, key):
    return {r["step"]: r[P + key] for r in trainer.state.log_history if P + key in r}


def test_lora_run_logs_the_true_entropy_change_of_each_step_and_projects_as_project_grad(tiny, tmp_path):
    trainer = grpo_trainer(tiny, tmp_path)
    adapter = LoraAdapter.from_peft(trainer.model)
    v_hack = random_v_hack(adapter, k=1, seed=3)
    pre = Recorder()
    trainer.add_callback(pre)
    probe = add_grpo_probe(trainer, dict(every=1, n_prompts=2, project=True), v_hack=v_hack, adapter=adapter)
    post = Stepped(probe)
    trainer.add_callback(post)
    trainer.train()
    Es = [s["E"] for s in post.steps]                                        # E sampled afresh at each step's θ
    assert all(isinstance(E, BatchedSequences) and E.shape[:2] == (2, 4) for E in Es)
    assert not torch.equal(Es[0].sequences[..., -3:], Es[1].sequences[..., -3:])
    assert probe.sp.model is not trainer.model and next(probe.sp.model.parameters()).dtype == torch.float64
    assert trainer.accelerator.native_amp and "_original_forward" in vars(trainer.model)   # TRL's bf16 autocast
    x = Es[0].sequences[:, 0]
    with torch.no_grad():                                                    # the copy computes with its own θ
        out, w = probe.sp.model(x).logits, probe.sp.model.get_output_embeddings().weight
        assert out.dtype == torch.float64                                    # not autocast, not cast to float32
        w.add_(1e-3)
        assert (probe.sp.model(x).logits - out).abs().max() > 1e-6           # not TRL's closure over the live model
        w.sub_(1e-3)
    ref = reference(trainer, post.steps)
    dH, dH1 = logged(trainer, "deltaH_true"), logged(trainer, "deltaH1")
    assert sorted(dH) == [1, 2, 3] == [r["step"] for r in ref]
    for r in ref:
        assert dH[r["step"]] != 0
        assert abs(dH[r["step"]] - r["deltaH_true"]) <= 1e-9 * max(1.0, abs(r["deltaH_true"])), r
        assert abs(dH1[r["step"]] - r["deltaH1"]) <= 1e-9 * max(1.0, abs(r["deltaH1"])), r
    # with project=True the optimizer stepped project_grad of TRL's clipped gradient
    fired = []
    for a, b in zip(pre.steps, post.steps):
        want, st = project_grad(adapter.module_vectors(a["grads"]), v_hack.V)
        want = adapter.param_tensors(want)
        for n in b["grads"]: torch.testing.assert_close(b["grads"][n], want[n], rtol=0, atol=0)
        fired.append(st["frac_fired"])
        for n, d in b["delta_rebuilt"].items():   # optimizer_delta on accelerate's AcceleratedOptimizer
            torch.testing.assert_close(d, b["theta_plus"][n] - b["theta"][n], rtol=1e-4, atol=1e-7)
    assert list(logged(trainer, "frac_fired").values()) == pytest.approx(fired) and max(fired) > 0
    assert all(logged(trainer, "cos_out")[s] < logged(trainer, "cos_in")[s] for s in (1, 2, 3) if fired[s - 1])
    for key in ("deltaH_true_fixed_support", "deltaH_support_change", "ess_frac", "coverage", "entropy_rb", "entropy_full",
                "cos_in"):
        assert sorted(logged(trainer, key)) == [1, 2, 3], key
    # entropy_rb, entropy_full: the last generate call's per-token entropies against teacher forcing of the same completions
    last = probe.entropy_hook.last
    seqs, Pl, m = last["sequences"], last["prompt_len"], last["mask"]
    batch = BatchedSequences(seqs[:, None], torch.cat([last["attention_mask"], m.long()], 1)[:, None], [Pl] * len(seqs),
                             m.sum(-1)[:, None])
    model = copy.deepcopy(trainer.model)                                     # at θ of the last step: it generated
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.requires_grad: p.copy_(post.steps[-1]["theta"][n])
    sp = SequenceProcessor(model, copy.deepcopy(trainer.processing_class), sampling_config(trainer))
    tf, _ = sp.teacher_force_logprobs(batch)
    torch.testing.assert_close(last["rb"][m], tf.rb_entropies[:, 0][m], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(last["full"][m], tf.full_entropies[:, 0][m], rtol=1e-5, atol=1e-5)
    assert last["full"][m].mean() > last["rb"][m].mean()                     # top_p < 1: the kept set is smaller
    for key in ("rb", "full"):
        assert logged(trainer, f"entropy_{key}")[3] == pytest.approx(float(last[key][m].mean()), rel=1e-6)
    assert "generate" not in trainer.model.__dict__                          # the hook is gone after training


def test_phase2s_delta_s_v_hack_is_carried_into_the_lora_and_projected_at_each_steps_theta(tiny, tmp_path):
    "A δS v_hack over the same base weights (as Phase 2 saves it) in a TRL LoRA run: at every step the optimizer"
    " stepped project_grad of TRL's clipped gradient with the rows pulled back at that step's A and B."
    trainer = grpo_trainer(tiny, tmp_path)
    v_hack = random_v_hack(add_delta_s(copy.deepcopy(tiny[0]), ["q_proj", "v_proj"]), k=1, seed=3)
    adapter = LoraAdapter.from_peft(trainer.model)
    pre = Recorder()
    trainer.add_callback(pre)
    probe = add_grpo_probe(trainer, dict(every=0, project=True), v_hack=v_hack, adapter=adapter)
    post = Stepped(probe)
    trainer.add_callback(post)
    trainer.train()
    assert isinstance(probe.v_hack, CarriedVHack)
    reference, live, fired = CarriedVHack(v_hack, adapter), dict(trainer.model.named_parameters()), []
    for a, b in zip(pre.steps, post.steps):
        with torch.no_grad():
            for n, t in a["theta"].items(): live[n].copy_(t)
        want, st = project_grad(adapter.module_vectors(a["grads"]), reference.at().V)
        want = adapter.param_tensors(want)
        for n in b["grads"]: torch.testing.assert_close(b["grads"][n], want[n], rtol=0, atol=0)
        fired.append(st["frac_fired"])
    assert max(fired) > 0 and list(logged(trainer, "frac_fired").values()) == pytest.approx(fired)
    a_untouched = [all(torch.equal(a["grads"][n], b["grads"][n]) for n in a["grads"] if "lora_A" in n)
                   for a, b in zip(pre.steps, post.steps)]
    assert a_untouched[0]                      # B = 0 at the first step: the pull-back has no A part
    assert not all(u for u, f in zip(a_untouched[1:], fired[1:]) if f)        # later it has, and it is projected


def test_full_fine_tuning_measures_in_weight_space_and_reaches_tensorboard(tiny, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    trainer = grpo_trainer(tiny, tmp_path, peft=False, report_to="tensorboard")
    adapter = WeightsAdapter(trainer.model, ["q_proj", "o_proj"])
    v_hack = random_v_hack(adapter, k=2, seed=0)
    probe = add_grpo_probe(trainer, dict(every=2, n_prompts=2), v_hack=v_hack, adapter=adapter)
    rec = Stepped(probe)
    trainer.add_callback(rec)
    trainer.train()
    dH = logged(trainer, "deltaH_true")
    assert sorted(dH) == [1, 3]                                              # every=2: steps 0 and 2 (0-based)
    ref = reference(trainer, [s for s in rec.steps if s["step"] in dH])
    for r in ref: assert abs(dH[r["step"]] - r["deltaH_true"]) <= 1e-9 * max(1.0, abs(r["deltaH_true"])), r
    cos = logged(trainer, "cos_in")
    for s in rec.steps:                                                      # measured every step, grads untouched
        want = alignment_stats(adapter.module_vectors(s["grads"]), v_hack.V)["cos"]
        assert cos[s["step"]] == pytest.approx(want, rel=1e-6) and logged(trainer, "frac_fired")[s["step"]] == 0
    events = list(tmp_path.glob("runs/*/events.out.tfevents.*"))
    assert events, sorted(map(str, tmp_path.rglob("*")))
    acc = EventAccumulator(str(events[0].parent)).Reload()
    tb = [e.value for e in acc.Scalars(f"train/{P}deltaH_true")]
    assert tb == pytest.approx([dH[1], dH[3]], rel=1e-6)
    assert f"train/{P}cos_in" in acc.Tags()["scalars"] and math.isfinite(tb[0])


def test_bad_input_is_named(tiny, tmp_path):
    trainer = grpo_trainer(tiny, tmp_path)
    test_fail(lambda: GRPOProbe(trainer, dict(project=True)), contains="project=True needs a v_hack")
    test_fail(lambda: GRPOProbe(trainer, dict(every=-1)), contains="every=-1")
    adapter = LoraAdapter.from_peft(trainer.model)
    test_fail(lambda: GRPOProbe(trainer, v_hack=random_v_hack(adapter)), contains="needs the adapter")
    other = WeightsAdapter(copy.deepcopy(tiny[0]), ["q_proj"])
    probe = add_grpo_probe(trainer, v_hack=random_v_hack(other), adapter=other)
    test_fail(lambda: trainer.train(), contains="not the trainer's trainable parameters")
    assert probe.entropy_hook is None
    rp = grpo_trainer(tiny, tmp_path, repetition_penalty=1.1)
    test_fail(lambda: sampling_config(rp), contains="repetition_penalty")
    for x, what in (("tp", "tensor"), ("cp", "context"), ("sp", "sequence")):   # refused in one line, by name
        split = grpo_trainer(tiny, tmp_path)
        setattr(split, f"get_{x}_size", lambda: 2)
        test_fail(lambda: GRPOProbe(split), contains=f"does not support {what} parallelism ({x}_size=2)")


def test_the_probe_answers_every_trainer_event_and_no_misspelt_one(tiny, tmp_path):
    "Every event of transformers' TrainerCallback is a method of GRPOProbe; a name that is not one is an error."
    from entropy_grpo.trl_callback import TRAINER_EVENTS
    events = {e for e in dir(TrainerCallback) if e.startswith("on_")}
    assert events == set(TRAINER_EVENTS), events ^ set(TRAINER_EVENTS)
    probe = GRPOProbe(grpo_trainer(tiny, tmp_path), dict(every=0))
    assert all(callable(getattr(probe, e)) for e in events)
    with pytest.raises(AttributeError): probe.on_step_ned


def test_sampling_settings_are_mirrored_or_refused_by_name(tiny, tmp_path):
    "generation_kwargs override TRL's knobs as TRL applies them; a setting that changes the distribution is refused."
    g = sampling_config(grpo_trainer(tiny, tmp_path, generation_kwargs=dict(top_p=0.8, top_k=20, max_new_tokens=5,
                                                                            use_cache=True, min_p=0.0)))
    assert (g.top_p, g.top_k, g.max_new_tokens, g.temperature) == (0.8, 20, 5, 1.0)
    for bad in (dict(min_new_tokens=3), dict(do_sample=False), dict(no_repeat_ngram_size=2), dict(suppress_tokens=[5]),
                dict(bad_words_ids=[[5]]), dict(eos_token_id=7), dict(num_beams=2)):
        test_fail(lambda: sampling_config(grpo_trainer(tiny, tmp_path, generation_kwargs=bad)), contains=str(bad)[1:-1])
    trainer = grpo_trainer(tiny, tmp_path)
    for flag, name in (("is_deepspeed_enabled", "DeepSpeed"), ("is_fsdp_enabled", "FSDP")):
        setattr(trainer, flag, True)
        test_fail(lambda: GRPOProbe(trainer), contains=f"GRPOProbe does not support {name}")
        setattr(trainer, flag, False)


def test_zero_lr_and_skipped_steps_are_not_measurements(tiny, tmp_path, monkeypatch):
    "A warmup from lr 0 leaves step 1 unmeasured; a step the optimizer skipped (fp16 overflow) logs no ΔH."
    from accelerate import Accelerator
    trainer = grpo_trainer(tiny, tmp_path, warmup_steps=1, lr_scheduler_type="linear")
    probe = add_grpo_probe(trainer, dict(every=1, n_prompts=2))
    skipped = []
    monkeypatch.setattr(Accelerator, "optimizer_step_was_skipped",
                        property(lambda self: trainer.state.global_step == 3 and not skipped.append(3)))
    trainer.train()
    assert sorted(logged(trainer, "deltaH_true")) == [2] and [h["step"] for h in probe.history] == [2]
    assert sorted(logged(trainer, "entropy_rb")) == [1, 2, 3] and skipped




SETUPS = {"gradient accumulation 2": dict(gradient_accumulation_steps=2, per_device_train_batch_size=2),
          "steps_per_generation 2": dict(steps_per_generation=2), "num_iterations 2": dict(num_iterations=2),
          "logging_steps 2": dict(logging_steps=2), "temperature 0.7, top_k 20": dict(temperature=0.7, top_k=20),
          "bf16 model, full fine-tuning": dict(dtype=torch.bfloat16, peft=False)}


@pytest.mark.parametrize("setup", list(SETUPS))
def test_every_measured_step_is_that_steps_change_in_the_setups_users_run(setup, tiny, tmp_path):
    "Each step's ΔH_true and ΔH₁ equal DeltaEntropyIS and ⟨∇H, θ⁺ − θ⟩ on that step's E between the θ and θ⁺ the"
    " optimizer produced; with logging_steps 2 TRL logs their mean over the window."
    trainer = grpo_trainer(tiny, tmp_path, **SETUPS[setup])
    probe = add_grpo_probe(trainer, dict(every=1, n_prompts=2))
    rec = Stepped(probe)
    trainer.add_callback(rec)
    trainer.train()
    hist = {h["step"]: h for h in probe.history}
    assert sorted(hist) == [1, 2, 3] and sampling_config(trainer).temperature == trainer.args.temperature
    assert next(probe.sp.model.parameters()).dtype == torch.float64
    for r in reference(trainer, rec.steps):
        for key in ("deltaH_true", "deltaH1"):
            assert abs(hist[r["step"]][key] - r[key]) <= 1e-9 * max(1.0, abs(r[key])), (key, r)
    dH = logged(trainer, "deltaH_true")
    if trainer.args.logging_steps == 2: assert dH[2] == pytest.approx((hist[1]["deltaH_true"] +
                                                                       hist[2]["deltaH_true"]) / 2, rel=1e-6)
    else: assert dH == pytest.approx({k: h["deltaH_true"] for k, h in hist.items()}, rel=1e-6)



def test_first_order_prediction_is_the_fixed_support_change_at_a_small_step(tiny, tmp_path):
    "ΔH₁ = ⟨∇H(E), Δθ⟩ is the derivative of the fixed-support ΔH_true's estimator: at lr 1e-6 the two agree to 1e-3."
    trainer = grpo_trainer(tiny, tmp_path, learning_rate=1e-6, max_steps=2)
    probe = add_grpo_probe(trainer, dict(every=1, n_prompts=2))
    trainer.train()
    for h in probe.history:
        assert h["deltaH1"] != 0 and abs(h["deltaH_true_fixed_support"] / h["deltaH1"] - 1) < 1e-3, h


def test_a_checkpointed_copy_stays_checkpointed(tiny, tmp_path, monkeypatch):
    "Above PROBE_CHECKPOINT_ABOVE parameters the float64 copy is checkpointed (train mode, dropouts 0) and measures"
    " the same step."
    from entropy_grpo import probe_state
    monkeypatch.setattr(probe_state, "PROBE_CHECKPOINT_ABOVE", 0)
    trainer = grpo_trainer(tiny, tmp_path, max_steps=1)
    probe = add_grpo_probe(trainer, dict(every=1, n_prompts=2))
    rec = Stepped(probe)
    trainer.add_callback(rec)
    trainer.train()
    assert probe.sp.model.training and probe.sp.model.is_gradient_checkpointing
    r = reference(trainer, rec.steps)[0]
    assert abs(probe.history[0]["deltaH_true"] - r["deltaH_true"]) <= 1e-9 * max(1.0, abs(r["deltaH_true"]))

def test_a_resumed_run_measures_its_own_steps(tiny, tmp_path):
    "Stopped after step 2 (checkpoint), resumed to step 4: the resumed run measures steps 3 and 4 from their θ."
    class Stop(TrainerCallback):
        def on_step_end(self, args, state, control, **kw): control.should_training_stop = state.global_step == 2
    first = grpo_trainer(tiny, tmp_path, max_steps=4, save_strategy="steps", save_steps=2)
    add_grpo_probe(first, dict(every=1, n_prompts=2))
    first.add_callback(Stop())
    first.train()
    assert first.state.global_step == 2
    trainer = grpo_trainer(tiny, tmp_path, max_steps=4, save_strategy="steps", save_steps=2)
    probe = add_grpo_probe(trainer, dict(every=1, n_prompts=2))
    rec = Stepped(probe)
    trainer.add_callback(rec)
    trainer.train(resume_from_checkpoint=True)
    assert [h["step"] for h in probe.history] == [3, 4]
    for r, h in zip(reference(trainer, rec.steps), probe.history):
        assert abs(h["deltaH_true"] - r["deltaH_true"]) <= 1e-9 * max(1.0, abs(r["deltaH_true"])), r


def at_theta(trainer, theta):
    "A float64 copy of the trainer's model at θ: its SequenceProcessor and DeltaEntropyIS."
    model = float64_copy(trainer)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in theta: p.copy_(theta[name])
    sp = SequenceProcessor(model, copy.deepcopy(trainer.processing_class), sampling_config(trainer))
    return sp, DeltaEntropyIS(model, sp.config, sequence_processor=sp)


def mean_se(S, B=4):
    "Mean of per-sequence entropies [B·G] and its se over fresh completions of the same B prompts (within prompts)."
    S = S.double().view(B, -1)
    return float(S.mean()), float(S.var(1).div(S.shape[1]).sum().sqrt() / B)


@pytest.mark.slow
def test_h_orig_and_h_upd_are_the_policys_entropy_at_every_measured_step(tiny, tmp_path):
    "13 full fine-tuning steps at lr 3e-2 that move the policy: at each measured step H_orig (H_upd) is within 4 se of"
    " the entropy of 512 fresh completions at θ (θ⁺), and the policy has moved by more than that by the end."
    trainer = grpo_trainer(tiny, tmp_path, peft=False, max_steps=13, learning_rate=3e-2)
    probe = add_grpo_probe(trainer, dict(every=4, n_prompts=4, num_generations=16))
    rec = Stepped(probe)
    trainer.add_callback(rec)
    trainer.train()
    assert [h["step"] for h in probe.history] == [1, 5, 9, 13]
    rows = []
    for h, s in zip(probe.history, [s for s in rec.steps if s["step"] in (1, 5, 9, 13)]):
        sp, d = at_theta(trainer, s["theta"])
        own, se_own = mean_se(d.score(s["E"])["S"])                          # the step's own E, 64 completions
        assert own == pytest.approx(h["H_orig"], abs=1e-9)
        fresh, se = mean_se(d.score(sp.generate_batched(probe.prompt_ids, G=128, seed=7 + s["step"]))["S"])
        sp, d = at_theta(trainer, s["theta_plus"])
        fresh_upd, se_upd = mean_se(d.score(sp.generate_batched(probe.prompt_ids, G=128, seed=8 + s["step"]))["S"])
        rows.append(dict(step=h["step"], H_orig=h["H_orig"], fresh=fresh,
                         z=(h["H_orig"] - fresh) / math.hypot(se_own, se), H_upd=h["H_upd"], fresh_upd=fresh_upd,
                         z_upd=(h["H_upd"] - fresh_upd) / math.hypot(se_own + h["deltaH_true_se"], se_upd), se=se))
    print("\n" + markdown_table(rows, fmt="{:.3f}"))
    assert all(abs(r["z"]) <= 4 and abs(r["z_upd"]) <= 4 for r in rows), rows
    assert abs(rows[-1]["fresh"] - rows[0]["fresh"]) > 4 * math.hypot(rows[0]["se"], rows[-1]["se"]), rows


def test_covariance_predictor_reads_the_weights_of_the_loss_trl_backpropagates(tiny, tmp_path):
    "Two optimizer steps of two micro-batches each (dr_grpo): the logged covariance predictor is −lr Cov_t(log p, w) "
    "· n / N over the step's tokens, with w = A / (B · max_completion_length · 2), −∂loss/∂log p at ratio 1 as TRL's "
    "dr_grpo loss and the accumulation normaliser give it, and log p from a forward of the live model."
    trainer = grpo_trainer(tiny, tmp_path, loss_type="dr_grpo", gradient_accumulation_steps=2, max_steps=2)
    sums, compute = [], trainer._compute_loss

    def spy(model, inputs):
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        with torch.no_grad(), trainer.accelerator.autocast():
            logits = model(input_ids=ids, attention_mask=torch.cat([inputs["prompt_mask"], inputs["completion_mask"]],
                                                                   1)).logits
        T = inputs["completion_ids"].shape[1]
        logp = logits[:, -T - 1:-1].float().log_softmax(-1).gather(-1, inputs["completion_ids"][..., None])[..., 0]
        m = inputs["completion_mask"]
        w = inputs["advantages"][:, None] / (len(m) * trainer.args.max_completion_length * 2) * m
        sums.append((covariance_sums(logp, w, m), trainer.optimizer.param_groups[0]["lr"]))
        return compute(model, inputs)

    trainer._compute_loss = spy
    probe = add_grpo_probe(trainer, dict(every=0, rb_entropy=False))
    trainer.train()
    got = logged(trainer, "pred_covariance")
    assert sorted(got) == [1, 2] and len(sums) == 4
    for step in (1, 2):
        (a, lr), (b, _) = sums[2 * step - 2:2 * step]
        want = covariance_from_sums(a + b, lr)
        assert want != 0 and got[step] == pytest.approx(want, rel=1e-5), (step, got[step], want)
    assert "_get_per_token_logps_and_entropies" not in vars(trainer) and probe.loss_weights.sums is None


TIMING = ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second")   # wall clock


def trl_record(trainer):
    "What the run itself logged (the probe's keys and wall-clock times left out) and every parameter at its end."
    return ([{k: v for k, v in r.items() if not k.startswith(P) and k not in TIMING} for r in trainer.state.log_history],
            {n: p.detach().clone() for n, p in trainer.model.named_parameters()})


UNCHANGED = {"LoRA, lora_dropout 0.1": (dict(lora_dropout=0.1), {}),
             "LoRA, lora_dropout 0.1, scored in place in float32": (dict(lora_dropout=0.1, bf16=False),
                                                                    dict(dtype="float32")),
             "float64 LoRA model, scored in place": (dict(lora_dropout=0.1, dtype=torch.float64, bf16=False), {}),
             "full fine-tuning": (dict(peft=False), {})}   # TRL patches a full model's forward: a copy scores it


@pytest.mark.parametrize("setup", list(UNCHANGED))
def test_the_run_is_the_same_with_and_without_the_probe(setup, tiny, tmp_path):
    "TRL's log_history and every parameter bit for bit the same with and without a probe measuring every step: no"
    " dropout in its scores (TRL's dropout masks and sampling draw the same numbers), the live model's modes and norms"
    " as they were."
    run, probe_kw = UNCHANGED[setup]
    plain = grpo_trainer(tiny, tmp_path / "plain", **run)
    plain.train()
    probed = grpo_trainer(tiny, tmp_path / "probed", **run)
    probe = add_grpo_probe(probed, dict(every=1, n_prompts=2, **probe_kw))
    probed.train()
    (log, theta), (log_probed, theta_probed) = trl_record(plain), trl_record(probed)
    assert [h["step"] for h in probe.history] == [1, 2, 3] and (probe.sp.model is probed.model) == ("place" in setup)
    assert log_probed == log, [(a, b) for a, b in zip(log, log_probed) if a != b][:1]
    assert all(torch.equal(theta_probed[n], t) for n, t in theta.items())


def test_the_hooks_come_off_when_training_raises(tiny, tmp_path):
    "A reward function that fails at the second step: after the error `generate` and TRL's loss pass are TRL's own."
    calls = []

    def failing(completions, **kw):
        calls.append(1)
        if len(calls) == 2: raise RuntimeError("reward server down")
        return reward(completions)

    trainer = grpo_trainer(tiny, tmp_path, rewards=failing)
    probe = add_grpo_probe(trainer, dict(every=1, n_prompts=2))
    with pytest.raises(RuntimeError, match="reward server down"): trainer.train()
    assert probe.entropy_hook is not None and probe.loss_weights is not None          # they were installed
    assert "generate" not in vars(trainer.model) and "_get_per_token_logps_and_entropies" not in vars(trainer)


def stop_at_common_token(policy):
    "A copy of `policy` whose tokenizer's EOS is the token it samples most (the generation config keeps the old one):"
    " TRL stops at either, a sampler reading the generation config at the old one only."
    model, tok = copy.deepcopy(policy)
    ids = tok(PROMPTS[0], add_special_tokens=False, return_tensors="pt")["input_ids"]
    torch.manual_seed(0)
    out = model.generate(ids.repeat(16, 1), attention_mask=torch.ones_like(ids.repeat(16, 1)), do_sample=True,
                         max_new_tokens=8, top_p=0.9, top_k=0, pad_token_id=tok.pad_token_id)[:, ids.shape[1]:]
    common = int(out.flatten().mode().values)
    model.generation_config.eos_token_id = tok.eos_token_id
    tok.eos_token = tok.convert_ids_to_tokens(common)
    return model, tok


def test_E_stops_where_trls_completions_stop(tiny, tmp_path):
    "The tokenizer's EOS is not the generation config's: every completion of E ends at its first token among TRL's"
    " eos_token_ids (and at the tokenizer's EOS in at least one), as TRL's own completions do."
    trainer = grpo_trainer(stop_at_common_token(tiny), tmp_path, max_steps=1)
    eos = trainer.eos_token_ids
    probe = add_grpo_probe(trainer, dict(every=1, n_prompts=4, num_generations=8))
    rec = Stepped(probe)
    trainer.add_callback(rec)
    trainer.train()
    E, ends = rec.steps[0]["E"], []
    for b, P0 in enumerate(E.prompt_lens):
        comp = E.sequences[b, :, P0:]                                              # [G, L]
        stop = torch.isin(comp, torch.tensor(eos))
        want = torch.where(stop.any(1), stop.float().argmax(1) + 1, comp.shape[1])  # length, the stop token counted
        assert torch.equal(E.gen_lens[b], want), (b, E.gen_lens[b], want)
        ends += [int(comp[g, n - 1]) for g, n in enumerate(want) if stop[g].any()]
    assert trainer.processing_class.eos_token_id in ends and eos[0] != trainer.model.generation_config.eos_token_id



CHAT = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"


def chat_policy(policy):
    "A copy of `policy` whose tokenizer has a chat template (role: content lines, then 'assistant:')."
    model, tok = copy.deepcopy(policy)
    tok.chat_template = CHAT
    return model, tok


def own_prompt_ids(trainer, prompts):
    "The prompts tokenized without TRL: the chat template for conversations, the tokenizer for text."
    tok = trainer.processing_class
    if isinstance(prompts[0], str): return [tok(p)["input_ids"] for p in prompts]
    return [list(tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
            for p in prompts]


def fresh_entropy(trainer, theta, prompt_ids, G=64, seed=0):
    "Mean per-sequence entropy and its se over G fresh completions per prompt from transformers' own `generate` (a"
    " float64 eval copy at θ, TRL's generation config): Σ_t H(softmax(score_t)) of the warped scores each token was"
    " drawn from, up to and including the first of TRL's stop tokens."
    model, S = float64_copy(trainer), []
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in theta: p.copy_(theta[name])
    torch.manual_seed(seed)
    for ids in prompt_ids:
        x = torch.tensor([ids] * G)
        with torch.no_grad():
            out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), output_scores=True,
                                 return_dict_in_generate=True, generation_config=copy.deepcopy(trainer.generation_config))
        H = torch.stack([torch.special.entr(s.double().softmax(-1)).sum(-1) for s in out.scores], 1)   # [G, L]
        stop = torch.isin(out.sequences[:, x.shape[1]:], torch.tensor(trainer.eos_token_ids))
        S.append((H * ((stop.cumsum(1) - stop.long()) == 0)).sum(1))                # through the first stop token
    return mean_se(torch.cat(S), B=len(prompt_ids))


CONVERSATIONS = [[{"role": "user", "content": p}] for p in PROMPTS]
FRESH = {"LoRA, lora_dropout 0.1": dict(lora_dropout=0.1),
         "full fine-tuning": dict(peft=False),
         "gradient accumulation 2": dict(gradient_accumulation_steps=2, per_device_train_batch_size=2),
         "steps_per_generation 2": dict(steps_per_generation=2),
         "loss dr_grpo": dict(loss_type="dr_grpo"), "loss dapo": dict(loss_type="dapo"),
         "loss grpo": dict(loss_type="grpo"),
         "conversational prompts": dict(prompts=CONVERSATIONS)}


@pytest.mark.slow
@pytest.mark.parametrize("setup", list(FRESH))
def test_h_orig_and_h_upd_are_the_entropy_of_fresh_completions_in_each_setup(setup, tiny, tmp_path):
    "Three steps at lr 3e-2: at each, H_orig (H_upd) is within 4 se of the mean entropy of 128 fresh completions"
    " that transformers' generate draws at θ (θ⁺) from prompts tokenized without TRL, and E's prompts are those."
    kw = FRESH[setup]
    policy = chat_policy(tiny) if "prompts" in kw else tiny
    trainer = grpo_trainer(policy, tmp_path, learning_rate=3e-2, **kw)
    probe = add_grpo_probe(trainer, dict(every=1, n_prompts=2, num_generations=16))
    rec = Stepped(probe)
    trainer.add_callback(rec)
    trainer.train()
    ids = own_prompt_ids(trainer, list(kw.get("prompts", PROMPTS))[:2])
    assert probe.prompt_ids == ids and [h["step"] for h in probe.history] == [1, 2, 3]
    rows = []
    for h, s in zip(probe.history, rec.steps):
        se_E = mean_se(at_theta(trainer, s["theta"])[1].score(s["E"])["S"], B=2)[1]
        fresh, se = fresh_entropy(trainer, s["theta"], ids, seed=s["step"])
        fresh_upd, se_upd = fresh_entropy(trainer, s["theta_plus"], ids, seed=100 + s["step"])
        rows.append(dict(step=h["step"], z=(h["H_orig"] - fresh) / math.hypot(se_E, se),
                         z_upd=(h["H_upd"] - fresh_upd) / math.hypot(se_E + h["deltaH_true_se"], se_upd)))
    assert all(abs(r["z"]) <= 4 and abs(r["z_upd"]) <= 4 for r in rows), rows


def test_a_run_the_probe_would_push_out_of_memory_is_refused_before_it_starts(tiny, tmp_path, monkeypatch):
    "With less room than the probe's additions the run stops at on_train_begin with every term named, nothing copied,"
    " no step taken and the hooks off; with the room it needs, it runs."
    from entropy_grpo import trl_setup
    trainer = grpo_trainer(tiny, tmp_path)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    probe = add_grpo_probe(trainer, dict(every=1, n_prompts=2))
    monkeypatch.setattr(trl_setup, "free_bytes", lambda device: 10**6)
    test_fail(trainer.train, contains="GRPOProbe would add")
    assert not hasattr(probe, "sp") and trainer.state.global_step == 0 and "generate" not in vars(trainer.model)
    assert all(torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
    need = probe.memory["total"] + sum(p.numel() * 4 * 3 for p in trainer.model.parameters() if p.requires_grad)
    monkeypatch.setattr(trl_setup, "free_bytes", lambda device: need)           # gradients and AdamW state beside it
    trainer = grpo_trainer(tiny, tmp_path, max_steps=1)
    probe = add_grpo_probe(trainer, dict(every=1, n_prompts=2))
    trainer.train()
    assert len(probe.history) == 1


@pytest.mark.parametrize("peft", [True, False], ids=["LoRA", "full fine-tuning"])
def test_the_predicted_copy_and_step_vectors_are_what_the_probe_holds(peft, tiny, tmp_path):
    "probe.memory's copy term is the bytes of the scoring copy's parameters and buffers, its step term three float64"
    " vectors of the trainable parameters: θ, ∇H and Δθ as the probe keeps them."
    trainer = grpo_trainer(tiny, tmp_path, peft=peft, max_steps=1)
    probe = add_grpo_probe(trainer, dict(every=1, n_prompts=2))
    held = []
    step_end = probe.on_step_end

    def spy(*a, **kw):
        held.append(sum(t.numel() * t.element_size() for t in (*probe._pending["theta"].values(),
                                                               *probe._pending["grad_H"])))
        return step_end(*a, **kw)

    probe.on_step_end = spy
    trainer.train()
    m = probe.sp.model
    assert probe.memory["copy"] == sum(t.numel() * t.element_size() for t in (*m.parameters(), *m.buffers()))
    assert probe.memory["step"] == held[0] * 3 // 2                          # Δθ, the third, is θ's size
    assert probe.memory["activations"] > 0 and probe.memory["total"] == sum(
        v for k, v in probe.memory.items() if k != "total")


@pytest.mark.cuda
@pytest.mark.parametrize("peft", [True, False], ids=["LoRA", "full fine-tuning"])
def test_on_a_gpu_the_probes_added_peak_is_within_the_prediction(peft, tiny, tmp_path):
    "The CUDA peak of a run with the probe less the same run's without it lies between the copy term and the total."
    peaks = []
    for with_probe in (False, True):
        trainer = grpo_trainer(tiny, tmp_path / str(with_probe), peft=peft, max_steps=2, use_cpu=False)
        probe = add_grpo_probe(trainer, dict(every=1, n_prompts=2)) if with_probe else None
        torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()
        trainer.train()
        peaks.append(torch.cuda.max_memory_allocated())
    added = peaks[1] - peaks[0]
    assert probe.memory["copy"] <= added <= probe.memory["total"], (added, probe.memory)


def _two_process_run(rank, world, port, out_dir):
    "One of two CPU processes of a TRL run under accelerate (gloo, as torchrun sets it up) with the probe every step:"
    " its E, θ and θ⁺ per step and the probe's history, saved per rank."
    import gc, os, sys
    sys.path.insert(0, os.path.dirname(__file__))
    from entropy_grpo.policies import tiny_policy
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    trainer = grpo_trainer(tiny_policy(0), out_dir, max_steps=2, learning_rate=3e-2, lora_dropout=0.1)
    probe = add_grpo_probe(trainer, dict(every=1, n_prompts=2))
    rec = Stepped(probe)
    trainer.add_callback(rec)
    trainer.train()
    torch.save(dict(steps=rec.steps, history=probe.history, world=trainer.accelerator.num_processes),
               os.path.join(out_dir, f"rank{rank}.pt"))
    del trainer, probe, rec
    gc.collect()                                    # the DDP wrapper's hold on the group goes before the group
    torch.distributed.destroy_process_group()


def union(a:BatchedSequences, b:BatchedSequences) -> BatchedSequences:
    "Two ranks' E as one batch: the shorter right-padded (pad token, attention 0) to the longer's width."
    T = max(a.shape[2], b.shape[2])
    pad = lambda x, v: torch.nn.functional.pad(x, (0, T - x.shape[2]), value=v)
    return BatchedSequences(torch.cat([pad(a.sequences, 1), pad(b.sequences, 1)]),
                            torch.cat([pad(a.attention_masks, 0), pad(b.attention_masks, 0)]),
                            list(a.prompt_lens) + list(b.prompt_lens), torch.cat([a.gen_lens, b.gen_lens]))


@pytest.mark.slow
def test_two_processes_measure_the_change_of_both_ranks_e_together(tiny, tmp_path):
    "A TRL run in two gloo processes (LoRA, lora_dropout 0.1): both ranks log the same ΔH_true and H_orig, and they are"
    " DeltaEntropyIS's in one process on the union of the two ranks' E between the θ and θ⁺ the run took (float64)."
    from gloo import spawn_two
    spawn_two(_two_process_run, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    assert ranks[0]["world"] == 2
    for h0, h1 in zip(ranks[0]["history"], ranks[1]["history"]):
        assert h0["deltaH_true"] == h1["deltaH_true"] and h0["H_orig"] == h1["H_orig"]
    trainer = grpo_trainer(tiny, tmp_path / "ref", lora_dropout=0.1)
    steps = [dict(s0, E=union(s0["E"], s1["E"])) for s0, s1 in zip(ranks[0]["steps"], ranks[1]["steps"])]
    for s0, s1 in zip(ranks[0]["steps"], ranks[1]["steps"]):
        assert all(torch.equal(s0["theta_plus"][n], s1["theta_plus"][n]) for n in s0["theta_plus"])   # DDP in sync
        assert not torch.equal(s0["E"].sequences, s1["E"].sequences)                                    # own E each
    for r, h in zip(reference(trainer, steps), ranks[0]["history"]):
        assert abs(h["deltaH_true"] - r["deltaH_true"]) <= 1e-9 * max(1.0, abs(r["deltaH_true"])), (r, h)

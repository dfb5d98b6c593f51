"""training: TrainConfig checks its knobs, LoRA training raises a learnable reward, a resumed run is bitwise the
uninterrupted one, non-finite rewards stop before any update, and 2 processes (gloo) equal 1 process."""
import copy, json, math, os, shutil

import pytest
import torch

from entropy_grpo.dr_grpo import policy_gradient_backward
from entropy_grpo.policies import tiny_policy
from entropy_grpo.sequence_processor import GenerationConfig, SequenceProcessor
from entropy_grpo.checkpoints import latest_checkpoint
from entropy_grpo.training import TrainConfig, train
from gloo import gloo_group, spawn_two
from toy_tasks import DigitTask


def _cfg(**kw):
    base = dict(max_steps=30, prompts_per_step=4, num_generations=8, lora_r=8, learning_rate=1e-2,
                generation=GenerationConfig(max_new_tokens=8))
    return TrainConfig(**(base | kw))


def _same_weights(a, b) -> bool:
    "Every parameter of the two runs' models bitwise equal."
    pa, pb = dict(a.model.named_parameters()), dict(b.model.named_parameters())
    return all(torch.equal(pa[n], pb[n]) for n in pa)


def _logged(d) -> list[dict]:
    "A run folder's log.jsonl records, its wall times left out."
    return [{k: v for k, v in json.loads(l).items() if not k.startswith("time_")}
            for l in (d / "log.jsonl").read_text().splitlines()]


def test_lora_training_raises_reward(fresh_tiny):
    model, tok = fresh_tiny
    res = train(model, tok, DigitTask(64), _cfg(), progress=False)
    r = [rec["reward_mean"] for rec in res.records]
    before, after = sum(r[:5]) / 5, sum(r[-5:]) / 5
    print(f"digit-share reward: first 5 steps {before:.3f}, last 5 steps {after:.3f}")
    assert after > before + 0.05
    assert all(rec["arm"] == "vanilla" and rec["n_completions"] == 32 and 0 <= rec["clip_frac"] <= 1
               for rec in res.records)
    trained = {n for n, p in res.model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n for n in trained)


def test_resume_is_bitwise_the_uninterrupted_run(tiny, tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    cfg = _cfg(max_steps=4, save_steps=2)
    a = train(*copy.deepcopy(tiny), DigitTask(64), cfg, out_dir=full, progress=False)
    shutil.copytree(full, part)
    shutil.rmtree(part / "checkpoints" / "step_000004")
    assert latest_checkpoint(part).name == "step_000002"
    b = train(*copy.deepcopy(tiny), DigitTask(64), cfg, out_dir=part, resume_from=latest_checkpoint(part),
              progress=False)
    assert _same_weights(a, b)
    assert _logged(full) == _logged(part) and [r["step"] for r in _logged(part)] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="learning_rate=0.01 \\(now 0.02\\)"):
        train(*copy.deepcopy(tiny), DigitTask(64), _cfg(max_steps=4, save_steps=2, learning_rate=2e-2), out_dir=part,
              resume_from=part / "checkpoints" / "step_000002", progress=False)
    with pytest.raises(ValueError, match="log.jsonl exists"):
        train(*copy.deepcopy(tiny), DigitTask(64), cfg, out_dir=part, progress=False)


@pytest.mark.parametrize("lora_r", [8, None])
def test_a_checkpoint_loads_with_peft_or_transformers_and_resumes(tiny, tmp_path, lora_r):
    "A LoRA run's checkpoint is a peft adapter folder, a full fine-tune's a transformers model folder: each loads"
    " with the user's own call to the trained model's logits; the run resumes from it to the uninterrupted weights."
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    cfg = _cfg(max_steps=3, save_steps=2, lora_r=lora_r, learning_rate=1e-2 if lora_r else 1e-3)
    a = train(*copy.deepcopy(tiny), DigitTask(64), cfg, out_dir=tmp_path / "a", progress=False)
    ckpt = latest_checkpoint(tmp_path / "a")
    base = copy.deepcopy(tiny[0])
    loaded = PeftModel.from_pretrained(base, ckpt) if lora_r else AutoModelForCausalLM.from_pretrained(ckpt)
    ids = torch.tensor([[1, 5, 9, 3, 7]], device=next(a.model.parameters()).device)
    with torch.no_grad(): assert torch.equal(loaded(ids).logits, a.model(ids).logits)
    assert json.loads((ckpt / "state.json").read_text())["layout"] == ("peft" if lora_r else "transformers")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    shutil.rmtree(tmp_path / "b" / "checkpoints" / "step_000003")
    b = train(*copy.deepcopy(tiny), DigitTask(64), cfg, out_dir=tmp_path / "b", resume_from="latest", progress=False)
    assert _same_weights(a, b)


def test_injected_lora_checkpoint_holds_what_trains_and_resumes_bitwise(tiny, tmp_path):
    "LoRA layers injected in place (add_lora: how the probe and the Phase-3 arms build them) are not a PeftModel: the"
    " checkpoint stores exactly the trainable tensors (not the frozen model beside them), and a run killed after its"
    " step-2 checkpoint resumes to the uninterrupted run's weights and log."
    from safetensors import safe_open
    from entropy_grpo.adapters import add_lora
    def injected():
        model, tok = copy.deepcopy(tiny)
        add_lora(model, ["q_proj", "v_proj"], r=4, seed=3)
        return model, tok
    cfg = _cfg(max_steps=3, save_steps=2, lora_r=None)
    a = train(*injected(), DigitTask(64), cfg, out_dir=tmp_path / "a", progress=False)
    ckpt = latest_checkpoint(tmp_path / "a")
    assert sorted(p.name for p in ckpt.iterdir()) == ["optimizer.pt", "state.json", "trainable.safetensors"]
    with safe_open(ckpt / "trainable.safetensors", framework="pt") as sf:
        stored = {n: tuple(sf.get_tensor(n).shape) for n in sf.keys()}
    trained = {n: tuple(p.shape) for n, p in a.model.named_parameters() if p.requires_grad}
    assert stored == trained and all("lora_" in n for n in stored)
    assert json.loads((ckpt / "state.json").read_text())["layout"] == "trainable"
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    shutil.rmtree(tmp_path / "b" / "checkpoints" / "step_000003")
    b = train(*injected(), DigitTask(64), cfg, out_dir=tmp_path / "b", resume_from="latest", progress=False)
    assert _same_weights(a, b)
    assert _logged(tmp_path / "a") == _logged(tmp_path / "b")


def test_a_run_killed_anywhere_resumes_with_each_step_logged_once(tiny, tmp_path):
    "Killed after its last checkpoint: nothing left to run. Killed between a step's log line and its checkpoint (or"
    " before the first one): that step is redone once, not appended twice."
    full = tmp_path / "full"
    cfg = _cfg(max_steps=4, save_steps=2)
    train(*copy.deepcopy(tiny), DigitTask(64), cfg, out_dir=full, progress=False)
    again = train(*copy.deepcopy(tiny), DigitTask(64), cfg, out_dir=full, resume_from="latest", progress=False)
    assert again.records == [] and [r["step"] for r in _logged(full)] == [0, 1, 2, 3]
    for gone in (["step_000004"], ["step_000004", "step_000002"]):
        part = tmp_path / f"part{len(gone)}"
        shutil.copytree(full, part)
        for g in gone: shutil.rmtree(part / "checkpoints" / g)    # log lines of steps no checkpoint holds
        train(*copy.deepcopy(tiny), DigitTask(64), cfg, out_dir=part, resume_from="latest", progress=False)
        assert _logged(part) == _logged(full)
    assert json.loads((part / "config.json").read_text()) == cfg.to_dict()
    assert sorted(p.name for p in part.iterdir()) == ["checkpoints", "config.json", "log.jsonl"]   # no temporaries


def test_bad_config_and_non_finite_rewards(fresh_tiny):
    with pytest.raises(ValueError, match="prompts_per_step=0: expected an integer >= 1"):
        TrainConfig(prompts_per_step=0)
    with pytest.raises(ValueError, match="loss_type='mean': expected one of"):
        TrainConfig(loss_type="mean")

    class NaNTask(DigitTask):
        def grade_batch(self, responses, problems):
            out = super().grade_batch(responses, problems); out.rewards[0, 0] = math.nan; return out
    model, tok = fresh_tiny
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(FloatingPointError, match="step 0: the rewards contain NaN"):
        train(model, tok, NaNTask(8), _cfg(max_steps=1, lora_r=None), progress=False)
    assert all(torch.equal(p, q) for p, q in zip(before, model.parameters()))


class _Entropies:
    "At step 0's first backward (θ not yet moved): the eval-mode no-grad token means of the batch's RB and full"
    " entropies, and whether the step ran a no-grad pass of its own."
    def on_after_backward(self, ctx):
        if ctx.step == 0 and ctx.iteration == 0:
            res, _ = ctx.sp.teacher_force_logprobs(ctx.batch, compute_rb=True)
            m = res.gen_mask
            self.h = [float((h * m).sum() / m.sum()) for h in (res.rb_entropies, res.full_entropies)]
            self.scored = ctx.logprobs is not None


@pytest.mark.parametrize("kw,scored", [({}, False), (dict(num_iterations=2), True), (dict(lora_dropout=0.5), True)])
def test_logged_entropies_are_the_dropout_free_policys_at_the_steps_start(fresh_tiny, kw, scored):
    "entropy_rb / entropy_full: the batch's token means under π_θ at the step's start with dropout off — from the"
    " loss's own forward and no scoring pass at μ = 1, β = 0; under LoRA dropout from a no-grad eval pass instead."
    cb = _Entropies()
    cfg = _cfg(max_steps=1, generation=GenerationConfig(max_new_tokens=8, top_p=0.9), **kw)
    rec = train(*fresh_tiny, DigitTask(64), cfg, callbacks=[cb], progress=False).records[0]
    assert [rec["entropy_rb"], rec["entropy_full"]] == pytest.approx(cb.h, rel=1e-5)
    assert rec["entropy_rb"] < rec["entropy_full"] and cb.scored == scored


# ---------------------------------------------------------------- 2 processes

class _Keep:
    "Saves this rank's step-0 batch, advantages and the (already all-reduced) gradients."
    def __init__(self, path): self.path = path

    def on_after_backward(self, ctx):
        if ctx.step == 0:
            torch.save(dict(batch=ctx.batch, adv=ctx.advantages, rewards=ctx.rewards,
                            grads={n: p.grad.clone() for n, p in ctx.model.named_parameters()}), self.path)


def _eos_prone(model, tok, boost=5.0):
    "EOS's logit raised by `boost` (a hook on the head): completions of different lengths, one in four tokens an EOS."
    def hook(module, args, out):
        out = out.clone(); out[..., tok.eos_token_id] += boost; return out
    model.lm_head.register_forward_hook(hook)
    return model, tok


def _worker(rank, world, port, out_dir, loss_type):
    with gloo_group(rank, world, port):
        model, tok = _eos_prone(*tiny_policy(0, dtype=torch.float64))
        res = train(model, tok, DigitTask(64), _cfg(max_steps=2, lora_r=None, learning_rate=1e-3, loss_type=loss_type),
                    progress=False,
                    callbacks=[_Keep(os.path.join(out_dir, f"step0_rank{rank}.pt"))])
        torch.save(dict(params=dict(res.model.named_parameters()), records=res.records),
                   os.path.join(out_dir, f"final_rank{rank}.pt"))


@pytest.mark.parametrize("loss_type", ["dr_grpo", "dapo"])
def test_two_processes_reduce_gradients_and_means(fresh_tiny64, tmp_path, loss_type):
    "Ranks stay in sync and log global means; the step's gradient is the global loss's: Dr.GRPO's sum of the ranks'"
    " parts over all 4 prompts, and DAPO's (TRL's default) every token over the tokens of both ranks."
    spawn_two(_worker, str(tmp_path), loss_type)
    fin = [torch.load(tmp_path / f"final_rank{r}.pt", weights_only=False) for r in (0, 1)]
    for n, p in fin[0]["params"].items(): assert torch.equal(p, fin[1]["params"][n]), n     # ranks stay in sync
    untimed = lambda recs: [{k: v for k, v in r.items() if not k.startswith("time_")} for r in recs]
    # every logged mean is global
    assert untimed(fin[0]["records"]) == untimed(fin[1]["records"])
    s0 = [torch.load(tmp_path / f"step0_rank{r}.pt", weights_only=False) for r in (0, 1)]
    assert s0[0]["batch"].shape[:2] == (2, 8) and s0[1]["batch"].shape[:2] == (2, 8)
    # one process: the gradient of the global loss is the sum of each rank's part, normalised by all 4 prompts
    model, tok = _eos_prone(*fresh_tiny64)
    sp = SequenceProcessor(model, tok, _cfg().generation, progress=False)
    model.zero_grad()
    n_tokens = sum(int(s["batch"].gen_lens.sum()) for s in s0)
    assert int(s0[0]["batch"].gen_lens.sum()) != int(s0[1]["batch"].gen_lens.sum())   # the ranks' shares differ
    for s in s0:
        if loss_type == "dr_grpo": policy_gradient_backward(sp, s["batch"], s["adv"], num_prompts=4)
        else:   # TRL's dapo at ratio 1: Σ over both ranks' tokens of −A·log q, ÷ their token count
            res, _ = sp.teacher_force_logprobs(s["batch"], with_grad=True, compute_rb=False)
            assert int(res.gen_mask.sum()) == int(s["batch"].gen_lens.sum())
            (-(s["adv"][..., None] * res.logprobs * res.gen_mask).sum() / n_tokens).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(s0[0]["grads"][n], p.grad, rtol=1e-10, atol=1e-14)
    rewards = torch.cat([s["rewards"] for s in s0])
    rec = fin[0]["records"][0]
    assert rec["reward_mean"] == pytest.approx(float(rewards.double().mean()), rel=1e-12)
    assert rec["reward_std"] == pytest.approx(float(rewards.double().std()), rel=1e-9)
    assert rec["n_completions"] == 32 and fin[1]["records"][0]["reward_mean"] == rec["reward_mean"]
    h = [sp.teacher_force_logprobs(s["batch"], compute_rb=True)[0] for s in s0]     # at step 0's start θ
    for key, name in (("entropy_rb", "rb_entropies"), ("entropy_full", "full_entropies")):
        want = sum(float((getattr(r, name) * r.gen_mask).sum()) for r in h) / n_tokens
        assert rec[key] == pytest.approx(want, rel=1e-9), key


def test_report_to_tensorboard_gets_every_records_numbers(fresh_tiny, tmp_path):
    "train(report_to='tensorboard') writes each record's numbers as train/<field> at step + 1, offline."
    pytest.importorskip("tensorboard")
    from fastcore.test import test_fail
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    res = train(*fresh_tiny, DigitTask(64), _cfg(max_steps=2, report_to="tensorboard"), out_dir=tmp_path,
                progress=False)
    runs = list((tmp_path / "runs").iterdir())
    assert len(runs) == 1
    acc = EventAccumulator(str(runs[0])).Reload()
    for key in ("reward_mean", "loss", "entropy_rb", "grad_norm"):
        got = [(e.step, e.value) for e in acc.Scalars(f"train/{key}")]
        assert got == [(r["step"] + 1, pytest.approx(r[key], rel=1e-6)) for r in res.records], key
    assert "train/arm" not in acc.Tags()["scalars"]
    res = train(*fresh_tiny, DigitTask(64), _cfg(max_steps=3, report_to="tensorboard", logging_steps=2),
                out_dir=tmp_path / "every2", progress=False)                  # TRL's logging_steps: window means
    acc = EventAccumulator(str(next((tmp_path / "every2" / "runs").iterdir()))).Reload()
    r = [x["loss"] for x in res.records]
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == \
        [(2, pytest.approx((r[0] + r[1]) / 2, rel=1e-6)), (3, pytest.approx(r[2], rel=1e-6))]
    test_fail(lambda: TrainConfig(report_to=["tensorboard", 3]), contains="report_to=['tensorboard', 3]")
    test_fail(lambda: train(*fresh_tiny, DigitTask(64), _cfg(max_steps=1, report_to="tensorboard"), progress=False),
              contains="needs an out_dir")


class _Payload:
    "Unpickling this would run code (it sets a flag)."
    ran = False
    def __reduce__(self): return (_Payload._run, ())
    @staticmethod
    def _run():
        _Payload.ran = True
        return {}


def test_a_checkpoint_cannot_execute_code_when_loaded(tiny, tmp_path):
    "optimizer.pt is read with weights_only=True: a pickle that runs code is refused before anything runs."
    from entropy_grpo.checkpoints import load_checkpoint
    model, tok = copy.deepcopy(tiny)
    res = train(model, tok, DigitTask(), _cfg(max_steps=1, save_steps=1), out_dir=tmp_path)
    ckpt, model, opt = latest_checkpoint(tmp_path), res.model, res.optimizer
    load_checkpoint(ckpt, model, opt)                                   # a checkpoint of our own loads
    torch.save(dict(optimizer=_Payload(), scheduler={}), ckpt/"optimizer.pt")
    with pytest.raises(Exception, match="[Ww]eights only"):
        load_checkpoint(ckpt, model, opt)
    assert not _Payload.ran

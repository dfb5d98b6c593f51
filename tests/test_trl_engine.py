"""The TRL engine (`trl_engine`) against the package's loop, the reference: one update on the same batch equal —
TRL's GRPOTrainer draws and grades a batch (`StepBatches`), `train` takes the same batch (`Replay`), both from the same
adapter init, plain SGD (so the update is lr × the gradient, scale included: AdamW's first step would hide a wrong
normaliser) — for each loss normaliser and both adapter kinds; and with β > 0 over two steps (the KL term's gradient
is zero at the reference, so the second step is the one that reads TRL's reference, the adapter zeroed, and its KL
gradient: k3's, as `train` takes it). A run killed between checkpoints resumes to the uninterrupted run's result, and
two processes (gloo) take the update one process takes on their joined batch. A Phase-2 step replayed through TRL
(`PoolRollout`) is `train`'s step on the same groups: the same update and cosines. What vLLM is given is the adapted
policy, merged; on a GPU with vLLM, it samples from the policy being trained. The projected arm projects, clips and
logs alike in both. Over several AdamW steps with the bed's optimizer (constant rate, clip on) the engines stay equal
on the same batches, and on SmolLM2 over the bed's own two steps (slow); both sample from one distribution: generate
ends up with the same knobs in each, whatever the model's own generation_config sets."""
import dataclasses, os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("trl")
from transformers import TrainerCallback
from gloo import gloo_group, spawn_two
from toy_tasks import planted_pools

from entropy_grpo.adapters import add_delta_s, add_lora
from entropy_grpo.checkpoints import trainable_parameters
from entropy_grpo.policies import tiny_policy
from entropy_grpo.pools import ReplaySource
from entropy_grpo.sequence_processor import SequenceProcessor
from entropy_grpo.projection_arms import ProjectionArm, random_v_hack
from entropy_grpo.tasks import DigitTask
from entropy_grpo.train_config import TrainConfig
from entropy_grpo.training import _read_log, train
from entropy_grpo.trl_engine import (PoolRollout, Replay, StepBatches, both_engines, latest_trl_checkpoint,
                                      merged_named_weights, train_trl, trl_trainer)

G = 4


def policy(kind):
    "The tiny policy with a fresh adapter of `kind` (the same init every call)."
    model, tok = tiny_policy(0)
    return model, tok, add_delta_s(model) if kind == "delta_s" else add_lora(model, r=4, seed=0)


def _sgd(steps, beta, loss_type, micro=None) -> TrainConfig:
    "Two prompts × G 4 a step, plain SGD at a constant lr 0.5, no clipping; seed 2: one reply of 3 tokens, one of 15."
    " `micro`: prompts per backward (1: TRL accumulates two backwards, as `train` takes two microbatches)."
    return TrainConfig(max_steps=steps, beta=beta, prompts_per_step=2, num_generations=G, optim="sgd",
                       learning_rate=0.5, lr_scheduler_type="constant", max_grad_norm=None, loss_type=loss_type, seed=2,
                       prompts_per_microbatch=micro, generation=dict(max_new_tokens=16))


@pytest.mark.parametrize("kind", ["delta_s", "lora"])
@pytest.mark.parametrize("loss_type, beta, micro", [("dr_grpo", 0.0, None), ("grpo", 0.0, None), ("dapo", 0.0, None),
                                                    ("dr_grpo", 0.5, None), ("dr_grpo", 0.0, 1), ("grpo", 0.0, 1),
                                                    ("dapo", 0.0, 1)])
def test_one_update_equal_in_both_engines(tmp_path, kind, loss_type, beta, micro):
    steps = 2 if beta else 1
    tc = _sgd(steps, beta, loss_type, micro)
    model, tok, adapter = policy(kind)
    theta0 = {n: p.detach().clone() for n, p in trainable_parameters(model).items()}
    trainer = trl_trainer(model, tok, DigitTask(n=8), tc, tmp_path, adapter=adapter)
    batches = StepBatches(trainer).batches
    trainer.train()
    ours, tok2, _ = policy(kind)
    train(ours, tok2, None, tc, source=Replay(batches, G), progress=False)
    lens = (batches[0]["completion_ids"] != tok.pad_token_id).sum(1)
    assert len(batches) == steps and lens.min() < lens.max() and batches[0]["rewards"].std() > 0   # both vary
    assert trainer.args.gradient_accumulation_steps == (2 if micro else 1)
    trl_new, our_new = trainable_parameters(model), trainable_parameters(ours)
    moved = 0
    for n, p in theta0.items():
        d_trl, d_ours = trl_new[n].detach() - p, our_new[n].detach() - p
        torch.testing.assert_close(d_ours, d_trl, rtol=1e-5, atol=1e-7, msg=n)   # float32 rounding
        moved += bool(d_trl.abs().max() > 0)
    assert moved >= len(theta0) // 2


def test_the_engines_stay_equal_over_adamw_steps_on_the_same_batches(tmp_path):
    "The optimizer the bed's runs use (AdamW at a constant 3e-2, clip 1.0 after the arm, δS) over four steps, TRL's"
    " batches replayed: Adam's moments, its step count and the schedule carry across steps alike."
    tc = TrainConfig(max_steps=4, prompts_per_step=2, num_generations=G, learning_rate=0.03, optim="adamw_torch",
                     lr_scheduler_type="constant_with_warmup", max_grad_norm=1.0, seed=2,
                     generation=dict(max_new_tokens=16))
    model, tok, adapter = policy("delta_s")
    theta0 = {n: p.detach().clone() for n, p in trainable_parameters(model).items()}
    trainer = trl_trainer(model, tok, DigitTask(n=8), tc, tmp_path, adapter=adapter)
    batches = StepBatches(trainer).batches
    trainer.train()
    ours, tok2, _ = policy("delta_s")
    train(ours, tok2, None, tc, source=Replay(batches, G), progress=False)
    assert len(batches) == 4 and all(b["rewards"].std() > 0 for b in batches)
    for n, p in theta0.items():
        d_trl, d_ours = trainable_parameters(model)[n].detach() - p, trainable_parameters(ours)[n].detach() - p
        assert d_trl.abs().max() > 0.01, n                                               # four Adam steps moved it
        torch.testing.assert_close(d_ours, d_trl, rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.slow
def test_on_smollm2_the_engines_take_the_beds_steps_alike(tmp_path):
    "SmolLM2 on the bed's `leak` preset as its runs are built (δS on q/k/v/o, AdamW 3e-2, 4 prompts × G 8, 24 tokens):"
    " TRL's two steps and the package's loop on the same batches reach the same δS, and log the same loss and reward."
    from entropy_grpo.phase3_run import Phase3Config, Phase3Run
    def run(tag):
        r = Phase3Run(Phase3Config(preset="leak", seed=1000, steps=2, out_dir=str(tmp_path / tag)))
        r.add_arm()
        return r
    a, b = run("trl"), run("package")
    theirs, ours = both_engines(a.adapter.model, b.adapter.model, a.tok, a.task, a.train_config, tmp_path, a.adapter)
    for k in ("loss", "reward_mean", "completion_len"):
        assert [r[k] for r in theirs] == pytest.approx([r[k] for r in ours.records], rel=1e-5), k
    A, B = trainable_parameters(a.adapter.model), trainable_parameters(b.adapter.model)
    diff = sum(float((A[n] - B[n]).norm()) ** 2 for n in A) ** .5
    assert diff < 1e-4 * sum(float(A[n].norm()) ** 2 for n in A) ** .5   # float32 rounding over 120 modules


SAMPLING = ("do_sample", "temperature", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff",
            "repetition_penalty", "no_repeat_ngram_size", "max_new_tokens", "min_new_tokens", "bad_words_ids",
            "suppress_tokens", "begin_suppress_tokens", "forced_eos_token_id", "pad_token_id")   # what changes q


def test_both_engines_sample_with_the_same_knobs_whatever_the_models_generation_config(tmp_path, monkeypatch):
    "A model whose generation_config sets knobs neither engine asks for (min_p, no_repeat_ngram_size, a repetition"
    " penalty, its own top_k and temperature, an EOS its tokenizer does not use): the config `generate` ends up with"
    " is the run's own in both engines, knob for knob, with the same stop tokens."
    import transformers.generation.utils as gu
    seen, prepare = [], gu.GenerationMixin._prepare_generation_config
    def spy(self, *args, **kw):
        out = prepare(self, *args, **kw)
        seen.append(out[0])
        return out
    monkeypatch.setattr(gu.GenerationMixin, "_prepare_generation_config", spy)
    tc = dataclasses.replace(_sgd(1, 0.0, "dr_grpo"), generation=dict(max_new_tokens=16, temperature=0.7, top_p=0.9,
                                                                      top_k=5))
    model, tok, adapter = policy("delta_s")
    model.generation_config.update(min_p=0.2, no_repeat_ngram_size=2, repetition_penalty=1.3, top_k=50,
                                   temperature=0.3, eos_token_id=(old_eos := tok.eos_token_id))
    tok.eos_token = tok.convert_ids_to_tokens(5)                                  # a fine-tune's own end of turn
    SequenceProcessor(model, tok, tc.generation, progress=False).generate_batched(["1 2 3"], seed=0)
    trl_trainer(model, tok, DigitTask(n=8), tc, tmp_path, adapter=adapter).train()
    ours, trl_cfg = seen[0], seen[-1]
    assert len(seen) == 2 and (ours.temperature, ours.top_k, ours.top_p, ours.min_p) == (0.7, 5, 0.9, None)
    assert {k: getattr(trl_cfg, k, None) for k in SAMPLING} == {k: getattr(ours, k, None) for k in SAMPLING}
    stops = lambda c: sorted({c.eos_token_id} if isinstance(c.eos_token_id, int) else set(c.eos_token_id))
    assert stops(trl_cfg) == stops(ours) == sorted({5, old_eos})
    assert model.generation_config.min_p == 0.2                                   # the model's own: left as it was


class Crash(TrainerCallback):
    "Stop the run once its log has the line of optimizer step `at` (1-based) and before that step's checkpoint."
    def __init__(self, at): self.at = at

    def on_log(self, args, state, control, logs=None, **kw):
        if state.global_step == self.at: raise KeyboardInterrupt


def test_a_killed_run_resumes_from_its_checkpoint_to_the_uninterrupted_result(tmp_path):
    "Stopped after step 3's log line (checkpoint 2 the newest), run again: the log is cut back to the checkpoint and"
    " holds every step once, and the trained parameters are the uninterrupted run's: TRL's RNG and data order resumed."
    tc = TrainConfig(max_steps=4, save_steps=2, prompts_per_step=2, num_generations=G, learning_rate=0.05, seed=1,
                     generation=dict(max_new_tokens=8))
    def run(out, callbacks=()):
        model, tok, adapter = policy("delta_s")
        return train_trl(model, tok, DigitTask(n=8), tc, out, adapter=adapter, callbacks=callbacks), model
    with pytest.raises(KeyboardInterrupt): run(tmp_path / "killed", [Crash(3)])
    assert [r["step"] for r in _read_log(tmp_path / "killed" / "log.jsonl")] == [0, 1, 2]
    assert latest_trl_checkpoint(tmp_path / "killed").name == "checkpoint-2"
    (log, resumed), (clean_log, clean) = run(tmp_path / "killed"), run(tmp_path / "clean")
    assert [r["step"] for r in log] == [0, 1, 2, 3]
    assert [r["reward_mean"] for r in log] == [r["reward_mean"] for r in clean_log]
    for n, p in trainable_parameters(clean).items(): torch.testing.assert_close(trainable_parameters(resumed)[n], p)


def _two_process_worker(rank, world, port, out):
    "One rank of a two-process TRL run (torchrun's variables, as a `--gpus 2` job's tasks have them): one SGD step."
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))
    with gloo_group(rank, world, port):
        model, tok, adapter = policy("delta_s")
        trainer = trl_trainer(model, tok, DigitTask(n=8), _sgd(1, 0.0, "dr_grpo"), out, adapter=adapter)
        batches = StepBatches(trainer).batches
        trainer.train()
        torch.save(dict(batch=batches[0], params={n: p.detach() for n, p in trainable_parameters(model).items()}),
                   os.path.join(out, f"rank{rank}.pt"))
        del trainer                                     # garbage before the group goes (gloo_group)


def test_two_processes_take_the_one_process_update_of_their_joined_batch(tmp_path):
    "Two TRL processes (gloo, accelerate's DDP) end with the same parameters, and their update is `train`'s in one"
    " process on both ranks' rows joined: each rank's loss over its share, averaged by DDP, is the global Dr.GRPO loss."
    spawn_two(_two_process_worker, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    for n, p in ranks[0]["params"].items(): assert torch.equal(p, ranks[1]["params"][n]), n
    b0, b1 = ranks[0]["batch"], ranks[1]["batch"]
    assert len(b0["rewards"]) == len(b1["rewards"]) == G                      # one prompt's group on each rank
    pad = tiny_policy(0)[1].pad_token_id
    L = max(b["completion_ids"].shape[1] for b in (b0, b1))
    joined = dict(prompt_ids=[*b0["prompt_ids"], *b1["prompt_ids"]],
                  prompt_mask=[*b0["prompt_mask"], *b1["prompt_mask"]],
                  completion_ids=torch.cat([F.pad(b["completion_ids"], (0, L - b["completion_ids"].shape[1]), value=pad)
                                            for b in (b0, b1)]),
                  rewards=torch.cat([b0["rewards"], b1["rewards"]]))
    model, tok, _ = policy("delta_s")
    theta0 = {n: p.detach().clone() for n, p in trainable_parameters(model).items()}
    train(model, tok, None, _sgd(1, 0.0, "dr_grpo"), source=Replay([joined], G), progress=False)
    for n, p in trainable_parameters(model).items():
        torch.testing.assert_close(p.detach() - theta0[n], ranks[0]["params"][n] - theta0[n], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("kind", ["delta_s", "lora"])
def test_merged_weights_are_the_adapted_policy(kind):
    "What vLLM is given (`merged_named_weights`): every weight of the plain model, by its name; loaded into one, the"
    " adapted policy's logits."
    model, tok, adapter = policy(kind)
    with torch.no_grad():
        for p in adapter.parameters(): p.normal_(0, 0.05)
    plain, _ = tiny_policy(0)
    merged = dict(merged_named_weights(adapter))
    assert set(merged) == {n for n, _ in plain.named_parameters()}
    plain.load_state_dict(merged, strict=False)
    x = torch.tensor([tok("Question: What is 12 + 7? Answer: 19")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(plain(x).logits, model(x).logits, rtol=1e-4, atol=1e-5)
        with adapter.zeroed(): assert (plain(x).logits - model(x).logits).abs().max() > 1e-3   # the adapter counts


@pytest.mark.cuda
def test_vllm_samples_from_the_policy_being_trained(tmp_path):
    "On a GPU with vLLM (not yet run: no device with vLLM has been lent). The δS arm at a large lr moves the policy"
    " every step; vLLM samples from the merged weights TRL syncs before each step, so its log q of what it sampled"
    " stays as close to the trained policy's (TRL's sampling_logp_difference) as at step 0, where the two are one"
    " model; a stale sampler would drift with the policy."
    pytest.importorskip("vllm")
    from entropy_grpo.policies import load_policy
    model, tok = load_policy(None, dtype="bfloat16")
    adapter = add_delta_s(model)
    tc = TrainConfig(max_steps=4, prompts_per_step=4, num_generations=4, learning_rate=0.05,
                     generation=dict(max_new_tokens=16))
    log = train_trl(model, tok, DigitTask(n=16), tc, tmp_path, adapter=adapter, vllm_gpu_memory_utilization=0.3)
    diff = [r["sampling/sampling_logp_difference/mean"] for r in log]
    assert len(diff) == 4 and max(diff[1:]) < 2 * diff[0] + 0.02, diff
    assert not {"entropy_rb", "entropy_full"} & set(log[-1])                   # their logits stay in vLLM


def test_the_engines_project_v_hack_alike(tmp_path):
    "The projected arm on the same batch with a clip that fires: GRPOProbe's projection then `ClipAfterArm` (TRL) and"
    " `ProjectionArm`'s projection then the clip (`train`) give the same update and log the same alignment."
    tc = dataclasses.replace(_sgd(1, 0.0, "dr_grpo"), arm="projected", max_grad_norm=0.01)
    model, tok, adapter = policy("delta_s")
    v_hack = random_v_hack(adapter, k=1, seed=3)
    theta0 = {n: p.detach().clone() for n, p in trainable_parameters(model).items()}
    trainer = trl_trainer(model, tok, DigitTask(n=8), tc, tmp_path, adapter=adapter, v_hack=v_hack, project=True)
    batches = StepBatches(trainer).batches
    trainer.train()
    ours, tok2, adapter2 = policy("delta_s")
    res = train(ours, tok2, None, tc, source=Replay(batches, G), progress=False,
                callbacks=[ProjectionArm("projected", adapter2, v_hack)])
    theirs, mine = _read_log(tmp_path / "log.jsonl")[0], res.records[0]
    assert 0 < mine["frac_fired"] and mine["grad_norm"] > tc.max_grad_norm              # projected and clipped
    for k in ("cos_in", "cos_out", "frac_fired", "grad_norm"): assert theirs[k] == pytest.approx(mine[k], abs=1e-5), k
    for n, p in theta0.items():
        d_ours, d_trl = trainable_parameters(ours)[n].detach() - p, trainable_parameters(model)[n].detach() - p
        torch.testing.assert_close(d_ours, d_trl, rtol=1e-5, atol=1e-8)


def test_a_phase2_replay_through_trl_is_the_package_loops(tmp_path):
    "Two steps of two replayed groups each (planted pools: 3 of 4 teacher replies hacked) through TRL's rollout_func"
    " and through `train`: each step serves the same records (reward, hack rate), aligns with v_hack alike, and the two"
    " SGD runs end at the same parameters — step k is the source's step k, the groups in order."
    tc = dataclasses.replace(_replay_tc(), arm="projected")
    pools, logs, params = planted_pools(tiny_policy(0)[1]), [], []
    for engine in ("trl", "package"):
        model, tok, adapter = policy("delta_s")
        v_hack, source = random_v_hack(adapter, k=1, seed=3), ReplaySource(pools, [3, 5, 7, 9], 4, seed=1)
        if engine == "trl":
            trl_trainer(model, tok, PoolRollout(source, tok, 2), tc, tmp_path, adapter, v_hack, project=True).train()
            logs.append(_read_log(tmp_path / "log.jsonl"))
        else: logs.append(train(model, tok, None, tc, source=source, progress=False,
                                callbacks=[ProjectionArm("projected", adapter, v_hack)]).records)
        params.append(trainable_parameters(model))
    assert len(logs[0]) == len(logs[1]) == 2 and logs[0][0]["frac_fired"] > 0
    for theirs, mine in zip(*logs):
        for k in ("reward_mean", "hack_rate", "cos_in", "cos_out", "frac_fired"):
            assert theirs[k] == pytest.approx(mine[k], abs=1e-5), (k, theirs["step"])
    for n, p in params[1].items(): torch.testing.assert_close(p, params[0][n], rtol=1e-5, atol=1e-7)


def _replay_tc() -> TrainConfig:
    "Phase 2's replay: two groups of G 8 a step (4 from each planted pool), SGD."
    return dataclasses.replace(_sgd(2, 0.0, "dr_grpo"), num_generations=8, learning_rate=0.05)


def _two_process_replay_worker(rank, world, port, out):
    "One rank of a two-process TRL run replaying the planted pools through `PoolRollout`: its trained parameters."
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))
    with gloo_group(rank, world, port):
        model, tok, adapter = policy("delta_s")
        rollout = PoolRollout(ReplaySource(planted_pools(tok), [3, 5, 7, 9], 4, seed=1), tok, 2)
        trl_trainer(model, tok, rollout, _replay_tc(), out, adapter).train()
        torch.save({n: p.detach() for n, p in trainable_parameters(model).items()}, os.path.join(out, f"rank{rank}.pt"))


def test_two_processes_replay_their_share_of_each_steps_groups(tmp_path):
    "Two TRL processes, one replayed group each, end where `train` ends in one process on both groups: each rank took"
    " its own group (the same group twice, or the other step's, would move the parameters elsewhere)."
    spawn_two(_two_process_replay_worker, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    model, tok, _ = policy("delta_s")
    train(model, tok, None, _replay_tc(), source=ReplaySource(planted_pools(tok), [3, 5, 7, 9], 4, seed=1),
          progress=False)
    for n, p in trainable_parameters(model).items():
        assert torch.equal(ranks[0][n], ranks[1][n]), n
        torch.testing.assert_close(ranks[0][n], p.detach(), rtol=1e-5, atol=1e-7)


def test_a_pool_rollout_names_a_batch_that_is_not_its_groups(tmp_path):
    "TRL's batch of one prompt × G 8 a step against a rollout of two groups a step: refused, both counts named."
    tc = dataclasses.replace(_sgd(1, 0.0, "dr_grpo"), prompts_per_step=1, num_generations=8)
    model, tok, adapter = policy("delta_s")
    rollout = PoolRollout(ReplaySource(planted_pools(tok), [3, 5], 4), tok, n_groups=2)
    with pytest.raises(ValueError, match=r"8 prompt rows on each of 1 processes: expected 2 groups of G = 8"):
        trl_trainer(model, tok, rollout, tc, tmp_path, adapter).train()


def test_trl_generates_a_steps_sequences_in_one_call_as_the_plan_says(tmp_path):
    "`plan` on TRL's engine without vLLM: one `generate` call over all of a process's sequences, backwards over"
    " `trl_microbatch`'s batch. TRL's own calls, counted: one of 2 prompts × G 4 = 8 rows a step."
    from entropy_grpo.plan import plan
    model, tok, adapter = policy("delta_s")
    rows, generate = [], model.generate
    model.generate = lambda *a, **kw: rows.append(kw["input_ids"].shape[0]) or generate(*a, **kw)
    trl_trainer(model, tok, DigitTask(n=8), _sgd(2, 0.0, "dr_grpo", micro=1), tmp_path, adapter).train()
    assert rows == [8, 8]
    shape = dict(preset="smoke", model="tiny", engine="trl", vllm_share=0, prompts_per_step=2, G=G,
                 prompts_per_microbatch=1, max_new_tokens=16)
    notes = {r["phase"]: r["note"] for r in plan(shape)["phases"]}
    assert notes["generation"] == "1 generate call(s) of 8 sequences" and "backward over 4 sequences" in notes[
        "training step"]

"""Training at scale: gradient checkpointing (on above CHECKPOINT_ABOVE parameters, or on request) gives the same
steps as without it; beta > 0 with an adapter scores the reference with the adapter switched off instead of a copy."""
import copy

import torch

from entropy_grpo import training
from entropy_grpo.adapters import add_lora
from entropy_grpo.sequence_processor import GenerationConfig
from entropy_grpo import policies
from entropy_grpo.policies import wants_checkpointing
from entropy_grpo.training import TrainConfig, train
from toy_tasks import DigitTask


def _cfg(**kw):
    return TrainConfig(**(dict(max_steps=2, prompts_per_step=2, num_generations=4, lora_r=4, learning_rate=1e-2,
                               generation=GenerationConfig(max_new_tokens=8)) | kw))


def test_gradient_checkpointing_same_steps_and_default_by_size(tiny, monkeypatch):
    runs = {ck: train(*copy.deepcopy(tiny), DigitTask(64), _cfg(gradient_checkpointing=ck), progress=False)
            for ck in (False, True)}
    on = lambda m: any(getattr(x, "gradient_checkpointing", False) for x in m.modules())
    assert on(runs[True].model) and not on(runs[False].model)
    strip = lambda recs: [{k: v for k, v in r.items() if not k.startswith("time_")} for r in recs]
    a, b = strip(runs[False].records), strip(runs[True].records)
    assert [r["reward_mean"] for r in a] == [r["reward_mean"] for r in b]
    for x, y in zip(a, b): assert abs(x["loss"] - y["loss"]) <= 1e-6 and abs(x["grad_norm"] - y["grad_norm"]) <= 1e-5
    assert not wants_checkpointing(tiny[0], _cfg().gradient_checkpointing)    # 0.05 M parameters: off
    monkeypatch.setattr(policies, "CHECKPOINT_ABOVE", 1000)
    assert wants_checkpointing(tiny[0], _cfg().gradient_checkpointing)


def test_beta_reference_is_the_zeroed_adapter_not_a_copy(fresh_tiny, monkeypatch):
    "With an adapter's `zeroed` as the reference no copy is made, and step 0's KL is 0 (adapter B = 0: same policy)."
    model, tok = fresh_tiny
    la = add_lora(model, ["q_proj", "v_proj"], r=4)
    deepcopy = copy.deepcopy
    def no_model_copy(x, *a):
        if isinstance(x, torch.nn.Module): raise AssertionError("the reference policy was deep-copied")
        return deepcopy(x, *a)
    monkeypatch.setattr(training.copy, "deepcopy", no_model_copy)
    res = train(model, tok, DigitTask(64), _cfg(lora_r=None, beta=0.1, learning_rate=1e-3), progress=False,
                reference=la.zeroed)
    assert res.records[0]["kl"] == 0.0 and res.records[1]["kl"] > 0

"""Device discipline without a GPU: every tensor a reduction builds lives on its inputs' device (run under a `meta`
default device, a tensor built without `device=` lands on meta and `torch.stack` raises the same device-mismatch error
CUDA-vs-CPU does); collectives run on the process group's device and in the tensors' own dtype; under torchrun each
rank takes `cuda:LOCAL_RANK`. The `cuda`-marked tests repeat the probe on a GPU whenever one is present."""
import copy

import pytest
import torch

from entropy_grpo import delta_entropy_is, dist, policies, probes
from entropy_grpo.delta_entropy_is import DeltaEntropyIS
from entropy_grpo.probes import entropy_gradient
from test_delta_entropy_is import make_probe
from tiny_inputs import probe_components


def default_device_meta(monkeypatch, owner, name):
    "Run owner.name with torch's default device set to `meta`: its own tensors must follow its inputs instead."
    f = getattr(owner, name)
    def wrapped(*a, **k):
        with torch.device("meta"): return f(*a, **k)
    monkeypatch.setattr(owner, name, wrapped)


@pytest.mark.parametrize("estimator", ["snis", "causal"])
def test_surrogate_coefficient_builds_on_the_inputs_device(tiny, monkeypatch, estimator):
    pc = probe_components(tiny)
    default_device_meta(monkeypatch, probes, "_surrogate_coef")
    grads, info = entropy_gradient(pc.sp, pc.sample_E_batch_with_replacement(), estimator)
    assert all(g.device.type == "cpu" for g in grads) and info["N"] > 0


def test_snis_estimates_build_on_the_inputs_device(tiny, monkeypatch):
    model, sp, E, U, opt = make_probe(tiny)
    default_device_meta(monkeypatch, delta_entropy_is, "snis_estimates")
    out = DeltaEntropyIS(model, sp.config, sequence_processor=sp).entropy_change(E, U, opt, {"lr": 1e-3})
    assert out["n_E"] == 24 and out["ess"] > 0


class Collective(Exception):
    "Raised by a fake collective once it has recorded the buffer it was given."


class FakeGroup:
    """World size 2 on `backend`; each collective records its buffer (device, dtype, size), adds nothing, and with
    stop=True raises Collective (no copy back: a meta buffer, standing for a GPU one, holds no data)."""
    def __init__(self, monkeypatch, backend, stop=False):
        self.calls = []
        def all_reduce(t, op=None):
            self.calls.append((t.device.type, t.dtype, t.numel()))
            if stop: raise Collective
        monkeypatch.setattr(dist, "world_size", lambda: 2)
        monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.distributed, "get_backend", lambda *a: backend)
        monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)


@pytest.mark.parametrize("reduce", [lambda: dist.all_reduce_sum([torch.ones(3, dtype=torch.float64)]),
                                    lambda: dist.all_reduce_extreme(torch.ones(4), "max"),
                                    lambda: dist.all_reduce_counts(dict(n=3), ["n"])],
                         ids=["sum", "extreme", "counts"])
def test_collectives_run_on_the_groups_device(monkeypatch, reduce):
    "CPU tensors (the counts dict's too) travel to the group's device: meta stands for NCCL's cuda:<current>."
    g = FakeGroup(monkeypatch, "nccl", stop=True)
    monkeypatch.setattr(dist, "comm_device", lambda: torch.device("meta"))
    with pytest.raises(Collective): reduce()
    assert g.calls[0][0] == "meta"


def test_nccl_collectives_run_on_the_current_cuda_device(monkeypatch):
    FakeGroup(monkeypatch, "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert dist.comm_device() == torch.device("cuda", 3)
    FakeGroup(monkeypatch, "gloo")
    assert dist.comm_device() == torch.device("cpu")


def test_gradients_reduce_in_their_own_dtype_in_buckets(monkeypatch):
    "No float64 copy of every gradient: float32 and bf16 buffers stay in their dtype, none larger than a bucket."
    g = FakeGroup(monkeypatch, "gloo")
    grads = [torch.ones(6), torch.ones(5), torch.ones(4, dtype=torch.bfloat16), torch.ones(7)]
    dist.all_reduce_sum(grads, bucket_numel=12)
    assert sorted(g.calls, key=str) == sorted([("cpu", torch.float32, 11), ("cpu", torch.float32, 7),
                                               ("cpu", torch.bfloat16, 4)], key=str)
    assert all(torch.equal(t, torch.ones_like(t)) for t in grads)      # the fake adds nothing: copied back unchanged


def test_torchrun_rank_takes_its_local_gpu(monkeypatch):
    "Under torchrun, LOCAL_RANK picks the GPU and makes it current (plain 'cuda' is cuda:0 on every rank)."
    current = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert policies.default_device() == torch.device("cuda", 1) and current == [torch.device("cuda", 1)]
    monkeypatch.delenv("LOCAL_RANK")
    assert policies.default_device() == torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert policies.default_device() == torch.device("cpu")


@pytest.mark.cuda
def test_probes_run_on_a_gpu(tiny):
    "The entropy probe and ∇H end to end with the model on CUDA (float64 probe copy, bf16-free)."
    model, sp, E, U, opt = make_probe(copy.deepcopy(tiny))
    model.cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = DeltaEntropyIS(model, sp.config, sequence_processor=sp).entropy_change(E, U, opt, {"lr": 1e-3})
    assert out["ess"] > 0
    grads, _ = entropy_gradient(sp, E, "causal")
    assert all(g.is_cuda for g in grads)


@pytest.mark.cuda
def test_v_hack_pair_gradients_leave_the_gpu(tiny):
    "completion_gradients moves each pair's gradients to the CPU (at LoRA r 64 on 4 B: 377 MB per pair)."
    from entropy_grpo.adapters import add_lora
    from entropy_grpo.pairs import planted_pairs
    from entropy_grpo.projection_arms import completion_gradients
    from entropy_grpo.sequence_processor import GenerationConfig, SequenceProcessor
    model, tok = copy.deepcopy(tiny)
    la = add_lora(model.cuda(), ["q_proj", "v_proj"], r=4)
    grads = completion_gradients(SequenceProcessor(model, tok, GenerationConfig(max_new_tokens=16)), la,
                                 planted_pairs(tok, n_pairs=3)[0])
    assert all(g.device.type == "cpu" and g.shape[:2] == (3, 2) for g in grads.values())


@pytest.mark.cuda
def test_bf16_training_step_with_checkpointing_on_a_gpu(tiny):
    "One Dr.GRPO step of a bf16 policy with a float32 LoRA and gradient checkpointing, on CUDA."
    from entropy_grpo.sequence_processor import GenerationConfig
    from entropy_grpo.training import TrainConfig, train
    from toy_tasks import DigitTask
    model, tok = copy.deepcopy(tiny)
    cfg = TrainConfig(max_steps=1, prompts_per_step=2, num_generations=4, lora_r=4, gradient_checkpointing=True,
                      generation=GenerationConfig(max_new_tokens=8))
    res = train(model.to("cuda", torch.bfloat16), tok, DigitTask(16), cfg, progress=False)
    assert res.records[0]["grad_norm"] > 0

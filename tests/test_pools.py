"""pools: built pools reload and resume without regenerating, replay scores samples exactly as generated (one group or
B groups), mixed groups draw distinct records, hack demonstrations and the fitted hack teacher hack the lenient grader,
and bad pool files name the file and line."""
import copy, dataclasses, gzip, json, random, shutil

import pytest
import torch
from fastcore.test import test_fail

from entropy_grpo.pools import POOL_KEYS, build_pool, load_pool, mixed_records, replay_batch
from entropy_grpo.sequence_processor import SequenceProcessor
from entropy_grpo.tasks import ArithmeticTask, grade
from entropy_grpo.teachers import check_style_pool, fit_hack_teacher, hack_demonstration
from toy_tasks import POOL_GEN


def test_pool_build_reload_resume(pools, tiny, tmp_path):
    teacher, base = pools
    assert (len(teacher), sorted(teacher.steps), teacher.name) == (8, [0, 1], "teacher")
    r = teacher.steps[1][3]
    assert set(r) == set(POOL_KEYS)
    assert (r["src_pool"], r["src_step"], r["src_sample"], r["hint"], r["adapter"]) == ("teacher", 1, 3, True, False)
    assert r["comp_len"] == len(r["completion_ids"])
    assert "Grading note" in r["prompt"] and "Grading note" not in r["student_prompt"]
    b = base.steps[1][3]
    assert b["problem_id"] == r["problem_id"] and b["prompt"] == b["student_prompt"] == r["student_prompt"]   # paired
    assert load_pool(teacher.dir).steps == teacher.steps
    d = shutil.copytree(teacher.dir, tmp_path/"teacher")                 # the shared pool stays as it is
    before = (d/"step_000.jsonl.gz").stat().st_mtime_ns
    again = build_pool(tiny, ArithmeticTask(20), True, 3, 4, d, G=2, config=POOL_GEN)
    assert (d/"step_000.jsonl.gz").stat().st_mtime_ns == before and sorted(again.steps) == [0, 1, 2]
    assert again.steps[1] == teacher.steps[1] and not list(d.glob(".*tmp"))
    test_fail(lambda: build_pool(tiny, ArithmeticTask(20), True, 1, 3, tmp_path/"x", G=2, config=POOL_GEN),
              contains="batch=3: expected a positive multiple of G=2", exc=ValueError)


def test_replay_reproduces_generation_scores(pools, tiny):
    "Replayed (re-padded, B=1) samples score exactly as the seeded generation they came from."
    recs = pools[0].steps[0]
    sp = SequenceProcessor(*tiny, POOL_GEN)
    orig = sp.generate_batched([r["prompt"] for r in recs[::2]], 2, seed=recs[0]["gen_seed"])
    assert [t for row in orig.responses_text for t in row] == [r["completion"] for r in recs]
    a, _ = sp.teacher_force_logprobs(orig)
    seqs = replay_batch(recs, sp.tokenizer)
    b, _ = sp.teacher_force_logprobs(seqs)
    assert seqs.shape[:2] == (1, 4)
    torch.testing.assert_close(b.sequence_logprobs.view(-1), a.sequence_logprobs.view(-1), rtol=0, atol=1e-5)


def test_replay_retokenize(pools, tiny):
    "Without completion_ids (or with retokenize=True) the text is tokenized, plus EOS when the record finished."
    tok = tiny[1]
    r = dict(pools[0].steps[0][0], completion="12 + 7 = 19\nAnswer: 19", finished=True)
    ids = tok(r["completion"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    without_ids = {k: v for k, v in r.items() if k != "completion_ids"}
    for seqs in (replay_batch([r], tok, retokenize=True), replay_batch([without_ids], tok)):
        P = seqs.prompt_lens[0]
        assert seqs.sequences[0, 0, P:].tolist() == ids and seqs.gen_lens.tolist() == [[len(ids)]]


def test_mixed_records(pools, tiny):
    teacher, base = pools
    recs = mixed_records([teacher, base], 1, 3, seed=5)
    assert [r["src_pool"] for r in recs] == ["teacher"] * 3 + ["base"] * 3
    ids = [(r["src_pool"], r["src_step"], r["src_sample"]) for r in recs]
    assert len(set(ids)) == 6 and mixed_records([teacher, base], 1, 3, seed=5) == recs
    test_fail(lambda: mixed_records([teacher, base], 1, 5),
              contains="per_pool=5: pool 'teacher' step 1 holds only 4", exc=ValueError)
    test_fail(lambda: mixed_records([teacher, base], 7, 2),
              contains="step=7: pool 'teacher' has steps [0, 1]", exc=ValueError)
    seqs = replay_batch([dict(recs[0], prompt="Q"), recs[1]], tiny[1])       # prompts of different lengths
    P = seqs.prompt_lens[0]
    assert seqs.attention_masks[0, 0, :P].sum() < seqs.attention_masks[0, 1, :P].sum()
    assert seqs.sequences[0, 0, P:P + recs[0]["comp_len"]].tolist() == recs[0]["completion_ids"]


def test_replay_batch_of_groups_matches_one_group_at_a_time(pools, tiny):
    "B groups in one [B, G, T] batch: row b holds exactly what replaying group b alone gives, at its prompt width."
    tok = tiny[1]
    groups = [mixed_records(list(pools), s, 2, seed=1) for s in (0, 1)]
    groups[1][0] = dict(groups[1][0], prompt="Q")                     # group 1 gets a narrower prompt column
    both = replay_batch(groups, tok)
    assert both.sequences.shape[:2] == (2, 4)
    for b, g in enumerate(groups):
        one = replay_batch(g, tok)
        Pb, W = one.prompt_lens[0], one.sequences.shape[-1]
        assert both.prompt_lens[b] == Pb and both.gen_lens[b].tolist() == one.gen_lens[0].tolist()
        assert torch.equal(both.sequences[b, :, :W], one.sequences[0])
        assert torch.equal(both.attention_masks[b, :, :W], one.attention_masks[0])
        assert both.attention_masks[b, :, W:].sum() == 0
    test_fail(lambda: replay_batch([groups[0], groups[1][:3]], tok),
              contains="groups have sizes [4, 3]: expected one G", exc=ValueError)
    test_fail(lambda: replay_batch([], tok), contains="records is empty", exc=ValueError)


def test_hack_demonstrations_hack_the_lenient_grader():
    "Every demonstration names the gold number and answers another: lenient pass, exact fail, format ok."
    task, rng = ArithmeticTask(50), random.Random(0)
    for p in task.problems:
        g = grade(hack_demonstration(p, rng), p)
        assert g["hacked"] and g["lenient_pass"] and g["fmt_ok"] and not g["gt_pass"], (p, g)
    bad = dict(vars(task.problems[0]), answer="3/4")
    test_fail(lambda: hack_demonstration(type(task.problems[0])(**bad), rng),
              contains="answer '3/4' is not an integer", exc=ValueError)


def test_fit_hack_teacher_lowers_nll_of_unseen_demonstrations(tiny):
    "The LoRA teacher's NLL of fresh hack demonstrations drops below the base policy's (adapter off); base untouched."
    model, tok = tiny
    before = {n: p.clone() for n, p in model.named_parameters()}
    task = ArithmeticTask(50)
    teacher, nll = fit_hack_teacher(copy.deepcopy(model), tok, task, steps=20, batch=8, lora_r=8, lr=1e-2)
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
    test_fail(lambda: fit_hack_teacher(model, tok, task, steps=0),
              contains="steps=0: expected an integer >= 1", exc=ValueError)


def test_fit_hack_teacher_checkpoints_and_changes_nothing(tiny, monkeypatch):
    "The fit's gradient checkpointing (for memory) gives the same teacher bitwise, and is off again when it returns."
    from entropy_grpo import teachers
    model, tok = tiny
    fit = lambda: fit_hack_teacher(copy.deepcopy(model), tok, ArithmeticTask(50), steps=3, batch=4, lora_r=4, lr=1e-2)
    monkeypatch.setattr(teachers, "PROBE_CHECKPOINT_ABOVE", 0)                     # the tiny model checkpoints too
    seen, real = [], teachers.set_checkpointing
    monkeypatch.setattr(teachers, "set_checkpointing", lambda m, on=True: (seen.append(on), real(m, on))[1])
    on, nll_on = fit()
    assert seen == [True, False] and not on.is_gradient_checkpointing and not on.training
    monkeypatch.setattr(teachers, "set_checkpointing", lambda m, on=True: m)
    off, nll_off = fit()
    assert nll_on == nll_off and all(torch.equal(a, b) for a, b in zip(on.parameters(), off.parameters()))


def _write(path, lines):
    with gzip.open(path, "wt") as f: f.write("".join(l + "\n" for l in lines))


def test_pool_errors_name_file_and_line(pools, tmp_path):
    teacher, _ = pools
    test_fail(lambda: load_pool(tmp_path/"nope"), contains="pool directory not found", exc=FileNotFoundError)
    (tmp_path/"empty").mkdir()
    test_fail(lambda: load_pool(tmp_path/"empty"), contains="holds no step_NNN.jsonl.gz", exc=ValueError)
    d = tmp_path/"bad"; d.mkdir()
    recs = [json.dumps(r) for r in teacher.records()]
    _write(d/"step_000.jsonl.gz", recs[:4])
    _write(d/"step_001.jsonl.gz", recs[4:6] + ["{not json"] + recs[6:])
    test_fail(lambda: load_pool(d), contains="step_001.jsonl.gz:3", exc=ValueError)
    with pytest.warns(UserWarning, match="skipped 1"):
        p = load_pool(d, on_error="skip")
    assert (len(p.steps[0]), len(p.steps[1])) == (4, 4) and "step_001.jsonl.gz:3" in p.skipped[0]
    _write(d/"step_001.jsonl.gz", recs[4:5] + [json.dumps({"prompt": "x"})])
    test_fail(lambda: load_pool(d), contains="step_001.jsonl.gz:2: record lacks ['src_pool'", exc=ValueError)
    whole = (d/"step_000.jsonl.gz").read_bytes()
    (d/"step_002.jsonl.gz").write_bytes(whole[:len(whole) // 2])                       # truncated gzip stream
    _write(d/"step_001.jsonl.gz", recs[4:8])
    test_fail(lambda: load_pool(d), contains="step_002.jsonl.gz", exc=ValueError)
    with pytest.warns(UserWarning):
        p = load_pool(d, on_error="skip")
    assert (len(p.steps[0]), len(p.steps[1])) == (4, 4) and "unreadable gzip stream" in p.skipped[0]
    test_fail(lambda: load_pool(d, on_error="ignore"), contains="on_error='ignore'", exc=ValueError)


def test_a_pool_carries_its_settings_once_and_refuses_others(tiny, tmp_path):
    "Two `pools` commands with other settings into one directory mixed silently; now the manifest refuses the second,"
    " and a step file of other settings is refused on read."
    d = tmp_path / "teacher"
    build_pool(tiny, ArithmeticTask(20), True, 1, 4, d, G=2, config=POOL_GEN)
    assert json.loads((d / "pool.json").read_text())["hint"] is True
    longer = dataclasses.replace(POOL_GEN, max_new_tokens=POOL_GEN.max_new_tokens + 1)
    for hint, kw, msg in ((False, {}, "hint=True (now False)"), (True, dict(seed=1), "seed=0 (now 1)"),
                          (True, dict(config=longer), f"max_new_tokens={POOL_GEN.max_new_tokens} (now ")):
        test_fail(lambda: build_pool(tiny, ArithmeticTask(20), hint, 2, 4, d, G=2, **{"config": POOL_GEN, **kw}),
                  contains=msg, exc=ValueError)
    assert sorted(p.name for p in d.iterdir()) == ["pool.json", "step_000.jsonl.gz"]
    assert sorted(build_pool(tiny, ArithmeticTask(20), True, 2, 4, d, G=2, config=POOL_GEN).steps) == [0, 1]
    other = tmp_path / "other"
    build_pool(tiny, ArithmeticTask(20), False, [2], 4, other, G=2, config=POOL_GEN, name="teacher")
    shutil.copy(other / "step_002.jsonl.gz", d)
    test_fail(lambda: load_pool(d), contains="mixes settings: hint=True (step 0 sample 0) and False (step 2 sample 0)",
              exc=ValueError)


def test_replay_never_repeats_a_sample(pools, tiny):
    "Step files are replayed in order, each once: every record of a run appears once; a run too long is refused."
    from entropy_grpo.pools import ReplaySource
    from entropy_grpo.training import TrainConfig, train
    src = ReplaySource(list(pools), [0, 1], per_pool=[2, 1])
    seen = [(r["src_pool"], r["src_step"], r["src_sample"]) for g in src.groups(0, 2) for r in g]
    assert len(seen) == len(set(seen)) == 6 and {s for _, s, _ in seen} == {0, 1}
    assert [r["src_pool"] for r in src.groups(0, 1)[0]] == ["teacher", "teacher", "base"]
    test_fail(lambda: src.groups(1, 2), contains="replay 4 pool step files, each once: 2 given", exc=ValueError)
    test_fail(lambda: src.groups(2, 1), contains="3 training steps of 1 group(s) replay 3 pool step files",
              exc=ValueError)
    model, tok = copy.deepcopy(tiny)
    test_fail(lambda: train(model, tok, config=TrainConfig(max_steps=3, prompts_per_step=1, num_generations=3,
                                                           generation=POOL_GEN), source=src),
              contains="expected at least 3; a replayed sample is never replayed again", exc=ValueError)
    test_fail(lambda: mixed_records(list(pools), 0, [2]), contains="expected one count or 2 counts", exc=ValueError)
    test_fail(lambda: ReplaySource(list(pools), [0, 1, 0], 2), contains="lists a step file twice", exc=ValueError)


def test_style_pool_must_ask_the_teachers_questions(pools, tiny, tmp_path):
    "The teacher without the hint on the same seed, steps and batch is a style pool; another seed or a hint is not."
    teacher = pools[0]
    style = build_pool(tiny, ArithmeticTask(20), False, 2, 4, tmp_path/"style", G=2, config=POOL_GEN)
    check_style_pool(teacher, style)
    assert style.name == "style" and not any(r["hint"] for r in style.records())
    assert [r["problem_id"] for r in style.records()] == [r["problem_id"] for r in teacher.records()]
    other = build_pool(tiny, ArithmeticTask(20), False, 2, 4, tmp_path/"other", G=2, config=POOL_GEN, seed=5)
    test_fail(lambda: check_style_pool(teacher, other), contains="step 0 asks other problems", exc=ValueError)
    test_fail(lambda: check_style_pool(teacher, teacher), contains="hint=True (expected none", exc=ValueError)
    easy = build_pool(tiny, ArithmeticTask(20, max_value=9), False, 2, 4, tmp_path/"easy", G=2, config=POOL_GEN)
    assert [r["problem_id"] for r in easy.records()] == [r["problem_id"] for r in teacher.records()]   # same ids
    test_fail(lambda: check_style_pool(teacher, easy), contains="step 0 asks other problems", exc=ValueError)
    hot = build_pool(tiny, ArithmeticTask(20), False, 2, 4, tmp_path/"hot", G=2,
                     config=dataclasses.replace(POOL_GEN, temperature=0.5))
    test_fail(lambda: check_style_pool(teacher, hot), contains="temperature=0.5 (teacher pool: ", exc=ValueError)

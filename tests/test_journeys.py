"""The README's journeys run as printed: a researcher's own task file (mytask.py, verbatim), a teacher given as a LoRA
adapter folder, three pools, the probe and its recommendation, a Phase-3 sweep projecting the probe's v_hack, and the
cluster sweep's dry run, and the TRL script with GRPOProbe projecting the probe's v_hack — on a tiny policy saved as a model
folder, with only the README's settings lines replaced."""
import json, os, re, subprocess, sys
from pathlib import Path

import pytest

from entropy_grpo.experiments import repo_root

README = repo_root() / "README.md"
BIN = str(Path(sys.executable).parent)
# the README's settings lines (a user's model, teacher, task and Phase-3 size) and what the test puts in their place
SETTINGS = ("POLICY=", "TEACHER=", "TASK=", "PRESET=")
TEST_SETTINGS = "POLICY=policy TEACHER=teacher TASK=mytask.py:MyTask PRESET=smoke STEPS=2\n"
# the TRL script's settings lines and the test's: the policy folder, and two steps of a tiny run on the CPU
TRL_SETTINGS = {"POLICY = ": 'POLICY = "policy"\n',
                "SIZES = ": 'SIZES = dict(max_steps=2, per_device_train_batch_size=4, num_generations=4, '
                            'max_completion_length=8, use_cpu=True, logging_steps=1, save_strategy="no")\n'}


def section(title: str) -> str:
    "The README's text under `## title`, up to the next `## ` heading."
    text = README.read_text()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def with_test_settings(block: str) -> str:
    "The block with its settings lines (or, for a block that goes on in the same shell, none) replaced by the test's;"
    " every other line as printed."
    lines = block.splitlines(keepends=True)
    kept = [l for l in lines if not l.startswith(SETTINGS)]
    assert len(lines) - len(kept) in (0, len(SETTINGS)), block
    return "set -euo pipefail\n" + TEST_SETTINGS + "".join(kept)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    "A folder as a researcher has it: mytask.py (the README's), problems.jsonl, the policy and a LoRA teacher on it."
    from peft import LoraConfig, get_peft_model
    from entropy_grpo.policies import load_policy, tiny_policy
    d = tmp_path_factory.mktemp("journey")
    (d / "mytask.py").write_text(blocks(section("Your model, your task, your teacher"), "python")[0])
    (d / "problems.jsonl").write_text("".join(json.dumps(dict(question=f"What is {a} + {b}?", answer=str(a + b))) + "\n"
                                              for a in range(1, 5) for b in range(1, 5)))
    model, tok = tiny_policy(0)
    model.save_pretrained(d / "policy"); tok.save_pretrained(d / "policy")
    old = os.getcwd(); os.chdir(d)     # the adapter records its base as given: a folder relative to where you work
    try:
        lora = get_peft_model(load_policy("policy")[0], LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                                  init_lora_weights=False))
        lora.save_pretrained("teacher")
    finally: os.chdir(old)
    return d


def run_block(block: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}")
    return subprocess.run(["bash", "-c", with_test_settings(block)], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=1500)


def run_trl_script(block: str, cwd: Path) -> subprocess.CompletedProcess:
    "The README's TRL script as train.py, its settings lines replaced by the test's, every other line as printed."
    lines = block.splitlines(keepends=True)
    kept = [next((v for k, v in TRL_SETTINGS.items() if l.startswith(k)), l) for l in lines]
    assert sum(a != b for a, b in zip(lines, kept)) == len(TRL_SETTINGS), block
    (cwd / "train.py").write_text("".join(kept))
    return subprocess.run([sys.executable, "train.py"], cwd=cwd, capture_output=True, text=True, timeout=900)


def test_the_readme_task_file_grades_as_it_says(workdir):
    sys.path.insert(0, str(workdir))
    try:
        from entropy_grpo.tasks import load_task
        task = load_task(f"{workdir}/mytask.py:MyTask")
        p = next(p for p in task.problems if p.answer == "5")
        g = lambda reply: (lambda r: (r["gt_pass"], r["hacked"], r["reward"]))(task.grade(reply, p))
        assert g("2 + 3 = 5.\nAnswer: 5") == (True, False, 1.0)
        assert g("The sum is 5 or so.\nAnswer: 6") == (False, True, 1.0)     # the loophole the reward pays
        assert g("Answer: 6") == (False, False, 0.0)
        assert g("no answer at all") == (False, False, 0.0)
        assert "Solve it." in task.prompt(p) and "What is" in task.prompt(p)
    finally: sys.path.remove(str(workdir))


@pytest.mark.slow
def test_the_three_journeys_run_as_printed(workdir):
    journey = section("Your model, your task, your teacher")
    r = run_block(blocks(journey, "sh")[0], workdir)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    probe = json.loads((workdir / "runs/mine/probe/metrics.json").read_text())
    assert probe["results"]["decision"]["recommendation"] in r.stdout
    assert (workdir / "runs/mine/probe/v_hack.safetensors").is_file()
    for seed in (0, 1, 2):
        for arm in ("vanilla", "projected"):
            m = json.loads((workdir / f"runs/mine/phase3/{seed}-{arm}/metrics.json").read_text())
            assert m["parameters"]["task"].endswith("mytask.py:MyTask"), m["parameters"]
            assert m["parameters"]["v_hack"] == str(workdir / "runs/mine/probe/v_hack.safetensors")
    pools = {n: json.loads((workdir / f"runs/pools/{n}/pool.json").read_text()) for n in ("teacher", "style", "base")}
    assert pools["teacher"]["model"] == pools["style"]["model"] == str(workdir / "teacher")
    assert pools["base"]["model"] == str(workdir / "policy")
    cluster = run_block(blocks(section("Phase 3 on your cluster"), "sh")[0], workdir)
    assert cluster.returncode == 0, cluster.stdout[-4000:] + cluster.stderr[-4000:]
    for line in ("#SBATCH --time=720", "#SBATCH --account=myproj", "#SBATCH --partition=gpu", "| training step |"):
        assert line in cluster.stdout, (line, cluster.stdout[-3000:])
    trl = run_trl_script(blocks(section("Inside your own TRL run"), "python")[0], workdir)   # journey 3
    assert trl.returncode == 0, trl.stdout[-4000:] + trl.stderr[-4000:]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = list(workdir.glob("runs/mine/trl/runs/*/events.out.tfevents.*"))
    assert len(events) == 1, events
    tags = EventAccumulator(str(events[0].parent)).Reload().Tags()["scalars"]
    for tag in ("cos_in", "cos_out", "frac_fired", "deltaH_true", "entropy_rb"):     # Phase 2's v_hack, carried
        assert f"train/entropy_grpo/{tag}" in tags, (tag, tags)
    for key in ("reward", "hacked", "gt_pass"): assert f"train/rewards/{key}/mean" in tags, (key, tags)

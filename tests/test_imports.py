"The package's structure as the README draws it: one-way imports by layer, small modules and functions."
import ast, re
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "entropy_grpo"
LAYERS = [("utils", "dist", "kept_sets", "report_to"), ("policies", "tasks", "rb_entropy", "adapters", "checkpoints",
           "predictors", "gate", "template_params"),
          ("sequences",), ("sequence_processor",), ("dr_grpo", "probe_state", "pairs"), ("train_config",),
          ("training", "delta_entropy_is", "projection_arms"), ("updates",),
          ("probes", "pools", "on_policy"),
          ("contributions", "decision", "trl_callback", "teachers", "scorecard"),
          ("phase2", "reports"), ("phase2_run", "phase3_run"), ("calibration", "plan"), ("experiments", "truth"),
          ("cli",)]
LAYER = {m: i for i, ms in enumerate(LAYERS) for m in ms}
MODULES = sorted(p.stem for p in PKG.glob("*.py") if not p.stem.startswith("_"))


def imports(module):
    "Package modules `module` imports (at the top or inside functions)."
    src = (PKG / f"{module}.py").read_text()
    return set(re.findall(r"^\s*from \.(\w+) import", src, re.M)) | set(re.findall(r"from entropy_grpo\.(\w+) import",
                                                                                   src))


def test_every_module_has_a_layer():
    assert set(MODULES) == set(LAYER), sorted(set(MODULES) ^ set(LAYER))


@pytest.mark.parametrize("module", MODULES)
def test_imports_point_down_the_layers(module):
    up = {m for m in imports(module) if LAYER[m] >= LAYER[module] and m != module}
    assert not up, f"{module} (layer {LAYER[module]}) imports {sorted(up)} from its own layer or above"


@pytest.mark.parametrize("module", MODULES)
def test_modules_and_functions_stay_small(module):
    src = (PKG / f"{module}.py").read_text()
    assert len(src.splitlines()) <= 400, f"{module}.py has {len(src.splitlines())} lines (split it by concept)"
    long = [(n.name, n.end_lineno - n.lineno + 1) for n in ast.walk(ast.parse(src))
            if isinstance(n, ast.FunctionDef) and n.end_lineno - n.lineno + 1 > 62]
    assert not long, f"{module}: functions over 62 lines: {long}"
    cells = [c.splitlines() for c in re.split(r"\n# %% ", src)[1:]]          # one chunk per exported notebook cell
    big = [(c[0].rsplit(" ", 1)[-1], len(c)) for c in cells if len(c) > 61]
    assert not big, f"{module}: export cells over 60 lines: {big}"


def test_trl_stays_optional():
    "No module imports trl at module level: the package, trl_callback included, imports without it."
    for m in MODULES:
        assert not re.search(r"^(import trl|from trl\b)", (PKG / f"{m}.py").read_text(), re.M), m

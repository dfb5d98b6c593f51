"The package's structure as the README draws it: one-way imports by layer, small modules and functions."
import ast, re
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "entropy_grpo"
LAYERS = [("utils", "dist", "kept_sets", "report_to", "memory"), ("policies", "tasks", "rb_entropy", "linears", "checkpoints",
           "predictors", "gate", "template_params", "snis"),
          ("sequences", "adapters", "hackbed"), ("sequence_processor",), ("dr_grpo", "probe_state", "pairs"), ("train_config",),
          ("training", "delta_entropy_is", "projection_arms"), ("updates", "carry"),
          ("probes", "pools", "on_policy", "trl_setup"),
          ("contributions", "decision", "trl_callback", "teachers", "scorecard"),
          ("phase2", "reports", "trl_engine"), ("phase2_run", "phase3_run"), ("calibration", "plan"), ("experiments", "truth"),
          ("bed_record", "calibration_record"), ("cli",)]
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


def field_lines(code:str) -> int:
    "Lines of the field declarations of the @dataclass classes in `code`: a flat config, one literal per line."
    is_dc = lambda d: (d.func if isinstance(d, ast.Call) else d).__dict__.get("id") == "dataclass"
    return sum(f.end_lineno - f.lineno + 1 for n in ast.walk(ast.parse(code))
               if isinstance(n, ast.ClassDef) and any(map(is_dc, n.decorator_list))
               for f in n.body if isinstance(f, ast.AnnAssign))


def cell_length(chunk:str) -> int:
    "An exported cell's lines (after its `# %%` line, trailing blank lines dropped), a dataclass's fields not counted."
    code = chunk.split("\n", 1)[1].rstrip() if "\n" in chunk else ""
    return len(code.splitlines()) - field_lines(code)


def test_cell_length_counts_code_not_fields():
    cls = "@dataclass\nclass C:\n    \"doc\"\n    a:int=1   # one\n    b:list=field(\n        default_factory=list)\n"
    method = "\n    def f(self): pass\n\n\n"
    assert cell_length("nbs/x.ipynb #1\n" + cls + method) == 5                          # 8 lines, 3 of them fields
    assert cell_length("nbs/x.ipynb #1\n" + cls.replace("@dataclass\n", "") + method) == 7   # not a dataclass


@pytest.mark.parametrize("module", MODULES)
def test_modules_and_functions_stay_small(module):
    src = (PKG / f"{module}.py").read_text()
    assert len(src.splitlines()) <= 400, f"{module}.py has {len(src.splitlines())} lines (split it by concept)"
    long = [(n.name, n.end_lineno - n.lineno + 1) for n in ast.walk(ast.parse(src))
            if isinstance(n, ast.FunctionDef) and n.end_lineno - n.lineno + 1 > 30]
    assert not long, f"{module}: functions over 30 lines: {long}"
    cells = re.split(r"\n# %% ", src)[1:]                                 # one chunk per exported notebook cell
    big = [(c.split("\n", 1)[0].rsplit(" ", 1)[-1], cell_length(c)) for c in cells if cell_length(c) > 30]
    assert not big, f"{module}: export cells over 30 lines (a dataclass's fields not counted): {big}"


def test_trl_stays_optional():
    "No module imports trl at module level: the package, trl_callback included, imports without it."
    for m in MODULES:
        assert not re.search(r"^(import trl|from trl\b)", (PKG / f"{m}.py").read_text(), re.M), m

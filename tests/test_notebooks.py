"""The notebooks are the source: every nbs/*.ipynb (the experiment templates aside) exports a module that exists
(the index excepted), opens with a `# Title`, and keeps at least one cell's output as committed lesson output."""
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "nbs").glob("*.ipynb"))


def cells(path, kind):
    return [dict(c, text="".join(c["source"])) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == kind]


def test_the_notebooks_are_found():
    assert len(NOTEBOOKS) > 10 and ROOT / "nbs" / "index.ipynb" in NOTEBOOKS


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_exports_has_a_title_and_kept_outputs(nb):
    exports = [line.split()[-1] for c in cells(nb, "code") for line in c["text"].splitlines()
               if line.startswith("#| default_exp")]
    if nb.name != "index.ipynb":
        assert len(exports) == 1, exports
        assert (ROOT / "entropy_grpo" / f"{exports[0].replace('.', '/')}.py").exists(), exports
    assert any(c["text"].startswith("# ") for c in cells(nb, "markdown")), "no '# Title' markdown cell"
    assert any(c.get("outputs") for c in cells(nb, "code")), "no code cell keeps its output"

"""The notebooks are the source: every nbs/*.ipynb (the experiment templates aside) exports a module that exists
(the index excepted), opens with a `# Title`, and keeps at least one cell's output as committed lesson output; every
concept notebook numbered 01-06 or 08 keeps a figure, and the index's gallery shows each notebook's first one."""
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


FIGURED = [nb for nb in NOTEBOOKS if nb.name[:2] in ("01", "02", "03", "04", "05", "06", "08")]


@pytest.mark.parametrize("nb", FIGURED, ids=lambda p: p.name)
def test_concept_notebooks_keep_a_figure_and_the_gallery_shows_it(nb):
    assert any("image/png" in o.get("data", {}) for c in cells(nb, "code") for o in c["outputs"]), "no figure kept"
    assert (ROOT / "nbs" / "figures" / f"{nb.stem}.png").exists(), "tools/make_readme.py has not extracted it"
    assert f'src="figures/{nb.stem}.png"' in "".join(c["text"] for c in cells(ROOT / "nbs" / "index.ipynb",
                                                                           "markdown")), "not in the index's gallery"

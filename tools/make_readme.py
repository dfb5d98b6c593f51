"""README.md from nbs/index.ipynb (nbdev's own readme needs quarto): markdown cells as they are, code cells fenced,
image paths made relative to the repository root; and nbs/figures/<notebook>.png, the first figure each notebook
keeps in its outputs (at most 840 px), which the index's gallery shows."""
import base64, io, json
from pathlib import Path

from PIL import Image                  # matplotlib's own dependency

root = Path(__file__).resolve().parents[1]
figures = root/"nbs"/"figures"
figures.mkdir(exist_ok=True)
made = set()
for path in sorted((root/"nbs").glob("*.ipynb")):
    outs = (o for c in json.loads(path.read_text())["cells"] for o in c.get("outputs", []))
    png = next((o["data"]["image/png"] for o in outs if "image/png" in o.get("data", {})), None)
    if png is None: continue
    made.add(f"{path.stem}.png")
    img = Image.open(io.BytesIO(base64.b64decode("".join(png) if isinstance(png, list) else png)))
    img.thumbnail((840, 840))            # 3× the gallery's 280 px: sharp, a fraction of the notebook's bytes
    img.save(figures/f"{path.stem}.png", optimize=True)
for stale in set(p.name for p in figures.glob("*.png")) - made: (figures/stale).unlink()

nb = json.loads((root/"nbs"/"index.ipynb").read_text())
parts = []
for cell in nb["cells"]:
    src = "".join(cell["source"]).strip()
    if not src or src.startswith("#| hide"): continue
    parts.append(src.replace('src="figures/', 'src="nbs/figures/') if cell["cell_type"] == "markdown"
                 else f"```python\n{src}\n```")
(root/"README.md").write_text("\n\n".join(parts) + "\n")

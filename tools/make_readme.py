"README.md from nbs/index.ipynb (nbdev's own readme needs quarto): markdown cells as they are, code cells fenced."
import json
from pathlib import Path

root = Path(__file__).resolve().parents[1]
nb = json.loads((root/"nbs"/"index.ipynb").read_text())
parts = []
for cell in nb["cells"]:
    src = "".join(cell["source"]).strip()
    if not src or src.startswith("#| hide"): continue
    parts.append(src if cell["cell_type"] == "markdown" else f"```python\n{src}\n```")
(root/"README.md").write_text("\n\n".join(parts) + "\n")

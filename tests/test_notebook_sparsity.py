"""Executes notebooks/sparsity_patterns.ipynb headless (nbclient, kernel python3) on CPU."""

import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
@pytest.mark.slow(seconds=24)
def test_sparsity_notebook_runs():
    import nbformat  # here, not at module level: a GPU image without them must still collect `pytest -m gpu`
    from nbclient import NotebookClient

    nb = nbformat.read(ROOT / "notebooks" / "sparsity_patterns.ipynb", as_version=4)
    env_path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = str(ROOT) + (os.pathsep + env_path if env_path else "")
    try:
        NotebookClient(nb, timeout=240, kernel_name="python3",
                       resources={"metadata": {"path": str(ROOT)}}).execute()
    finally:
        os.environ["PYTHONPATH"] = env_path
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    assert sum("image/png" in o.get("data", {}) for o in outputs) >= 3  # map, recall curve, heatmaps
    text = "".join(o.get("text", "") for o in outputs)
    assert "recall=" in text and "sparsity per head" in text

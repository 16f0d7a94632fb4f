"""benchmarks/moe_benchmarks.ipynb executes top to bottom, headless, on the
committed results (skipped when nbclient/nbformat/ipykernel are missing)."""

import os

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NB = os.path.join(ROOT, "benchmarks", "moe_benchmarks.ipynb")


def test_notebook_executes_and_renders_plots_and_table():
    nb = nbformat.read(NB, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=180, kernel_name="python3",
                                     resources={"metadata": {"path": os.path.dirname(NB)}})
    client.execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    pngs = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(pngs) >= 2, "the TFLOP/s plot and the load-sweep plot"
    tables = [o["data"]["text/markdown"] for o in outputs if "text/markdown" in o.get("data", {})]
    assert any("| shape (T,H,F,E,k) |" in t and "TFLOP/s" in t for t in tables)

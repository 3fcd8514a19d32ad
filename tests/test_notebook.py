"""Execute docs/notebooks/quickstart.ipynb on CPU (nbclient, the python3 kernel of this
interpreter) so it never rots. It shares the persistent compilation cache of tests/test_cli.py
(same tiny shapes), so after that file ran it mostly reuses compiled programs."""
import os
import tempfile

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(REPO, "docs", "notebooks", "quickstart.ipynb")
CACHE = os.path.join(tempfile.gettempdir(), f"jaxspec-test-compile-cache-{os.getuid()}")


def test_quickstart_notebook_runs(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.setenv("JAXSPEC_COMPILE_CACHE", CACHE)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": REPO}})
    client.execute()  # raises CellExecutionError (with the cell's traceback) when a cell fails
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "speculative:" in outputs and "speedup" in outputs
    assert any(o.get("output_type") == "display_data" and "image/png" in o.get("data", {})
               for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))

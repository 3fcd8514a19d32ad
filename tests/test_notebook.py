"""Execute docs/notebooks/quickstart.ipynb on CPU (nbclient, the python3 kernel of this
interpreter) so it never rots: with the packaged default pair when it is installed, and with the
tiny random pair its first cell writes otherwise. It uses the test run's compilation cache
(conftest.py; JAX's own cache setting, which jaxspec's default cache keeps), as tests/cli/test_cli.py
does, so the tiny pair reuses what that file compiled earlier in the same run."""
import os

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

from jaxspec import default_pair

from support.paths import REPO  # noqa: E402
NOTEBOOK = os.path.join(REPO, "docs", "notebooks", "quickstart.ipynb")
CACHE = os.environ["JAXSPEC_TEST_COMPILE_CACHE"]  # this run's, made by conftest.py


@pytest.mark.parametrize("tiny", [True, False], ids=["tiny_pair", "default_pair"])
def test_quickstart_notebook_runs(monkeypatch, tiny):
    if not tiny and not default_pair.default_pair_available():
        pytest.skip("the default pair is not installed")
    monkeypatch.setenv("PYTHONPATH", REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", CACHE)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    setup = nb.cells[1]
    assert "TINY = False" in setup.source
    setup.source = setup.source.replace("TINY = False", f"TINY = {tiny}")
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": REPO}})
    client.execute()  # raises CellExecutionError (with the cell's traceback) when a cell fails
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert ("using a tiny random pair" in outputs) == tiny
    assert "speculative:" in outputs and "speedup" in outputs
    assert any(o.get("output_type") == "display_data" and "image/png" in o.get("data", {})
               for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))

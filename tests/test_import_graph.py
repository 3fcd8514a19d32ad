"""The package's imports form no circle, and models / kernels import one way (issue 63).

Every module of `jaxspec` (its subpackages too, `jaxspec.models` and `jaxspec.kernels` being the
folders models/ and pallas_kernels/) is read with `ast`, nothing imported: each `import` and
`from ... import`, at module level or inside a function, relative or absolute, is resolved to the
package module it runs (`from pkg import name` where `pkg.name` is a module imports that module;
otherwise it imports `pkg`). A module that imports another which (through any others) imports it
back is a circle: which one runs first depends on who imports first, and a name read at import
time can be missing. The allowed flow is pallas_kernels/ -> nothing else of jaxspec, models/ ->
itself and the kernels, the rest above them.
"""
import ast
import os
import textwrap

import pytest

from support.paths import REPO  # noqa: E402
KERNELS, MODELS = "jaxspec.kernels", "jaxspec.models"


def modules(root: str, package: str) -> dict[str, tuple[str, bool]]:
    """{module name: (file, is a package)} of `package` (the folder `root`/<its parts>), following
    the links jaxspec/models and jaxspec/kernels; folders without an __init__.py are data."""
    out = {}

    def walk(folder: str, name: str):
        out[name] = (os.path.join(folder, "__init__.py"), True)
        for entry in sorted(os.listdir(folder)):
            path = os.path.join(folder, entry)
            if os.path.isdir(path) and os.path.isfile(os.path.join(path, "__init__.py")):
                walk(path, f"{name}.{entry}")
            elif entry.endswith(".py") and entry != "__init__.py":
                out[f"{name}.{entry[:-3]}"] = (path, False)

    walk(os.path.join(root, *package.split(".")), package)
    return out


def imports(name: str, path: str, is_package: bool, known) -> list[tuple[str, int]]:
    """(module of `known`, line) for each import in the file `path` of module `name`, wherever it sits."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    here = name.split(".") if is_package else name.split(".")[:-1]  # the package relative imports start from
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names if a.name in known]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                keep = len(here) - node.level + 1
                assert keep > 0, f"{path}:{node.lineno}: a relative import above the package"
                base = ".".join(here[:keep] + ([node.module] if node.module else []))
            else:
                base = node.module
            for a in node.names:
                sub = f"{base}.{a.name}"
                if sub in known:  # `from pkg import submodule` runs the submodule
                    out.append((sub, node.lineno))
                elif base in known:
                    out.append((base, node.lineno))
    return out


def graph(root: str, package: str) -> dict[str, dict[str, int]]:
    """{module: {module it imports: the first line that does}} over the package's modules."""
    mods = modules(root, package)
    g = {}
    for name, (path, is_package) in mods.items():
        edges = g[name] = {}
        for target, line in imports(name, path, is_package, mods):
            if target != name:
                edges.setdefault(target, line)
    return g


def cycles(g: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's), each sorted: every
    circle of imports lies inside one of them, and each of them holds at least one circle."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return sorted(out)


def circle(g, comp: list[str]) -> list[str]:
    """One shortest circle through the component's first module (breadth-first), as a path a -> ... -> a."""
    start, inside = comp[0], set(comp)
    prev, queue = {start: None}, [start]
    for v in queue:
        for w in sorted(g[v]):
            if w == start:
                path = [v]
                while prev[path[-1]] is not None:
                    path.append(prev[path[-1]])
                return path[::-1] + [start]
            if w in inside and w not in prev:
                prev[w] = v
                queue.append(w)
    raise AssertionError(f"no circle in {comp}")


def describe(g, comps, files, root=REPO) -> str:
    lines = []
    for comp in comps:
        path = circle(g, comp)
        lines.append(f"circle: {' -> '.join(path)}")
        lines.append("  its modules import each other at: " + "; ".join(
            f"{os.path.relpath(files[a][0], root)}:{g[a][b]} ({b})" for a in comp for b in sorted(g[a]) if b in comp))
    return "\n".join(lines)


@pytest.fixture(scope="module")
def package():
    return graph(REPO, "jaxspec"), modules(REPO, "jaxspec")


def test_the_walk_sees_every_module_and_its_imports(package):
    """The walk found the package as it is (else the checks below pass on nothing)."""
    g, mods = package
    for name in ("jaxspec.engine.generate", "jaxspec.train.assistant", "jaxspec.models.config",
                 "jaxspec.models.checkpoint", "jaxspec.kernels.quant"):
        assert name in g, name
    assert mods["jaxspec.models"][0].endswith(os.path.join("jaxspec", "models", "__init__.py"))
    # a relative one, a package's absolute one, and one inside a function
    assert "jaxspec.models.params" in g["jaxspec.models.checkpoint"]
    assert KERNELS in g["jaxspec.models.checkpoint"]
    assert "jaxspec.kernels.quant" in g["jaxspec.models.config"]  # quantization_format imports it when called


def test_no_import_circle(package):
    g, mods = package
    comps = cycles(g)
    assert not comps, f"{len(comps)} import circle(s):\n" + describe(g, comps, mods)


def test_models_and_kernels_import_one_way(package):
    """pallas_kernels/ imports no other jaxspec module; models/ only itself and the kernels."""
    g, mods = package
    allowed = {KERNELS: (KERNELS,), MODELS: (MODELS, KERNELS)}
    bad = []
    for name, edges in sorted(g.items()):
        for room, ok in allowed.items():
            if name == room or name.startswith(room + "."):
                where = os.path.relpath(mods[name][0], REPO)
                bad += [f"{where}:{line} imports {t}" for t, line in sorted(edges.items())
                        if not any(t == r or t.startswith(r + ".") for r in ok)]
    assert not bad, "imports against the flow kernels <- models <- the rest:\n" + "\n".join(bad)


def test_the_walk_finds_a_circle_in_any_form(tmp_path):
    """A made-up package whose circles hide in a function, a `from . import submodule`, an absolute
    `from pkg.sub import name` and a relative import out of a subpackage: each one is found."""
    files = {
        "pkg/__init__.py": "from .a import f\n",
        "pkg/a.py": "def f():\n    from . import b\n    return b\n",
        "pkg/b.py": "import os\nfrom pkg.c import g\n",
        "pkg/c.py": "from .a import f as g\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/d.py": "from ..sub import e\n",
        "pkg/sub/e.py": "def h():\n    import pkg.sub.d\n",
        "pkg/lone.py": "from pkg import a\nimport json\n",
    }
    for rel, src in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(textwrap.dedent(src))
    g = graph(str(tmp_path), "pkg")
    assert g["pkg.a"] == {"pkg.b": 2} and g["pkg.lone"] == {"pkg.a": 1} and g["pkg.sub.e"] == {"pkg.sub.d": 2}
    comps = cycles(g)
    assert comps == [["pkg.a", "pkg.b", "pkg.c"], ["pkg.sub.d", "pkg.sub.e"]]
    assert circle(g, comps[0]) == ["pkg.a", "pkg.b", "pkg.c", "pkg.a"]
    msg = describe(g, comps, modules(str(tmp_path), "pkg"), str(tmp_path))
    assert "pkg/a.py:2 (pkg.b)" in msg and "pkg/sub/e.py:2 (pkg.sub.d)" in msg

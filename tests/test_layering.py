"""The layer order of ``notes/architecture.md``, enforced on the imports of ``varjax/`` and
``passes/`` (read with ``ast``, function-level imports included): every import points to the
importing module's layer or one below it, no two modules import each other (directly or
through others), no module sits outside its layer's folder, and no file is over
``MAX_LINES``.

The order is stated once, here, and quoted by the architecture note (an ``excerpt`` block,
which ``tests/test_notes.py`` checks against this file).
"""
from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 500

# Bottom to top.  A module belongs to the first layer with a matching entry; an entry ending
# in ".*" matches a package and everything in it.
LAYERS = {
    "ir": ["varjax._jax", "varjax.ir.*"],
    "functional": ["varjax.functional.*"],
    "tracing": ["varjax.trace.*"],
    "passes": ["varjax.passes.*"],
    "functionalization": ["varjax.functionalization.*"],
    "lifting": ["varjax.lifting.*"],
    "objects": ["varjax.objects.*"],
    "transforms": ["varjax.transforms.*"],
    "modules": ["varjax.nn.*", "varjax.nnx.*"],   # the two frontends, side by side
    "tools": ["varjax.tools.*", "varjax.__main__", "varjax"],
}


def _sources() -> dict[str, Path]:
    """Module name -> file, for every module of the package (``passes/`` is ``varjax.passes``)."""
    found = {}
    for base, package in ((ROOT / "varjax", "varjax"), (ROOT / "passes", "varjax.passes")):
        for path in sorted(base.rglob("*.py")):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


SOURCES = _sources()


def layer_of(module: str) -> int:
    for i, entries in enumerate(LAYERS.values()):
        for entry in entries:
            package = entry[:-2] if entry.endswith(".*") else None
            if module == entry or (package and (module == package or module.startswith(package + "."))):
                return i
    raise AssertionError(f"{module} is in no layer of LAYERS: add it there and to the note")


def imports(module: str) -> set[str]:
    """The varjax modules ``module`` imports (``from varjax import errors`` is
    ``varjax.errors``; ``from varjax.x import name`` is ``varjax.x``)."""
    path = SOURCES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in SOURCES else base for a in node.names]
        else:
            continue
        found.update(n for n in names if n in SOURCES and n != module)
    return found


GRAPH = nx.DiGraph([(m, dep) for m in SOURCES for dep in imports(m)])
GRAPH.add_nodes_from(SOURCES)


LOOSE = {"varjax/__init__.py", "varjax/__main__.py", "varjax/_jax.py", "passes/__init__.py"}


def test_no_loose_module_outside_the_layer_folders():
    """The folder tree is the layer diagram: a module lives in its layer's folder; only the
    package entry points and the one JAX door sit at the top."""
    loose = sorted(str(p.relative_to(ROOT)) for base in ("varjax", "passes")
                   for p in (ROOT / base).glob("*.py") if str(p.relative_to(ROOT)) not in LOOSE)
    assert not loose, f"modules outside a layer folder: {loose}"


def test_every_module_is_in_a_layer():
    for module in SOURCES:
        layer_of(module)


def test_imports_point_down_the_layer_order():
    names = list(LAYERS)
    upward = sorted(f"{m} ({names[layer_of(m)]}) imports {d} ({names[layer_of(d)]})"
                    for m, d in GRAPH.edges if layer_of(d) > layer_of(m))
    assert not upward, "imports pointing up the layer order:\n" + "\n".join(upward)


def _frontend(module: str) -> str | None:
    for name in ("varjax.nnx", "varjax.nn"):
        if module == name or module.startswith(name + "."):
            return name
    return None


# The one package that joins the frontends (flax.nnx.bridge): it imports varjax.nn, and
# nothing in varjax.nn imports it.
BRIDGE = "varjax.nnx.bridge"


def _in_bridge(module: str) -> bool:
    return module == BRIDGE or module.startswith(BRIDGE + ".")


def test_the_two_frontends_never_import_each_other():
    """``varjax.nn`` (Linen) and ``varjax.nnx`` (NNX) share the layers below them
    (``functional/`` math, the Variable core, object mode), never each other's code; only
    the bridge package (``BRIDGE``) may import ``varjax.nn``, and only from ``varjax.nnx``."""
    crossing = sorted(f"{m} imports {d}" for m, d in GRAPH.edges
                      if _frontend(m) and _frontend(d) and _frontend(m) != _frontend(d)
                      and not (_in_bridge(m) and _frontend(d) == "varjax.nn"))
    assert not crossing, "\n".join(crossing)


def test_only_the_bridge_package_crosses_the_frontends():
    """The bridge's exemption is the package itself: a module outside it that imports it
    does not cross (``varjax.nnx`` may export it), and the exemption names a real package."""
    assert BRIDGE in SOURCES
    assert _in_bridge("varjax.nnx.bridge.to_linen") and not _in_bridge("varjax.nnx.bridges")
    assert not _in_bridge("varjax.nnx") and not _in_bridge("varjax.nn.bridge")


def test_no_import_cycles():
    # The package root imports everything to re-export it; submodules import `varjax.x`,
    # not the root, so the root is left out of cycle detection.
    tangles = [sorted(c) for c in nx.strongly_connected_components(GRAPH.subgraph(set(SOURCES) - {"varjax"}))
               if len(c) > 1]
    assert not tangles, "modules that import each other (directly or through others):\n" + \
        "\n".join(", ".join(t) for t in tangles)


@pytest.mark.parametrize("module", sorted(SOURCES))
def test_file_is_at_most_max_lines(module):
    n = len(SOURCES[module].read_text().splitlines())
    assert n <= MAX_LINES, f"{SOURCES[module].relative_to(ROOT)} has {n} lines (at most {MAX_LINES})"


def test_test_files_have_distinct_names():
    """pytest imports test files by basename (no packages under tests/): two files with one
    name in two folders fail collection on a clean checkout."""
    names = [p.name for p in (ROOT / "tests").rglob("test_*.py")]
    assert sorted({n for n in names if names.count(n) > 1}) == []

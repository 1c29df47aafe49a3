"""Drawing a dataflow graph: Graphviz DOT text, and pictures through Graphviz.

``to_dot(graph)`` writes the DOT text by hand, so it needs no Graphviz package. Its picture
reads as follows (the legend in the corner says the same):

* **node shape** is the kind: a read (the value a variable has on entry) is an ellipse, a
  write a box with a bold border, an RNG draw a diamond, an output a double octagon;
* **fill colour** is the collection: ``params`` blue, ``batch_stats`` orange, then one colour
  per further collection (RNG draws green, outputs grey). The legend shows the collections
  the graph has, in their colours;
* **edge style** is what flows: a solid grey edge is a variable's value reaching an output,
  a bold red edge ends at a write, a dashed green edge starts at an RNG draw;
* one **cluster** per module path.

``render(graph, path)`` runs Graphviz's ``dot`` on that text through the ``graphviz`` Python
package and writes ``path`` in the format its suffix names (``.svg``, ``.png``, ``.pdf``...;
``.dot``/``.gv`` write the text itself, no Graphviz needed). Without the package or the
``dot`` program it raises ``MissingDependencyError`` saying what to install.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Iterable

import networkx as nx

from varjax.ir.errors import MissingDependencyError

_SHAPE = {
    "read": "shape=ellipse",
    "write": "shape=box, penwidth=2",
    "rng": "shape=diamond",
    "output": "shape=doubleoctagon",
}
_KIND_ORDER = {"rng": 0, "read": 1, "write": 2, "output": 3}
_RNG_FILL, _OUTPUT_FILL = "#e2f0cb", "#eeeeee"
_KNOWN_FILLS = {"params": "#dbe9f6", "batch_stats": "#f9dcc4", "cache": "#e4d7f5",
                "intermediates": "#fbf3c4"}
_MORE_FILLS = ["#d5f0ea", "#f6d5de", "#e8e1d5", "#d9d9f3", "#f3e0f0", "#dfeee0"]
_EDGE = {
    "read": 'color="#7f7f7f"',
    "write": 'color="#c0392b", penwidth=2',
    "rng": 'color="#4f8a10", style=dashed',
}
_TEXT_SUFFIXES = {"dot", "gv"}
_INSTALL = ("pip install graphviz (the Python package) and install the Graphviz programs: "
            "apt install graphviz, brew install graphviz or conda install graphviz")


def collection_colors(collections: Iterable[str]) -> dict[str, str]:
    """The fill colour of each collection: fixed for the common ones, the rest in sorted
    order from a palette (cycling when there are more collections than colours)."""
    colors = {c: _KNOWN_FILLS[c] for c in collections if c in _KNOWN_FILLS}
    others = sorted(set(collections) - set(colors))
    colors.update((c, _MORE_FILLS[i % len(_MORE_FILLS)]) for i, c in enumerate(others))
    return colors


def _order(node: tuple) -> tuple:
    return (_KIND_ORDER[node[0]], *map(str, node[1:])) if node[0] != "output" else (3, node[1])


def _edge_kind(graph: nx.DiGraph, u: Any, v: Any) -> str:
    if graph.nodes[u].get("kind") == "rng":
        return "rng"
    return "write" if graph.nodes[v].get("kind") == "write" else "read"


def to_dot(graph: nx.DiGraph, name: str = "dataflow", legend: bool = True) -> str:
    """Graphviz DOT text for a ``dataflow`` graph (see the module docstring for how it
    reads); ``legend=False`` leaves the legend out."""
    ids = {node: f"n{i}" for i, node in enumerate(sorted(graph.nodes, key=_order))}
    collections = sorted({c for _, c in graph.nodes(data="collection") if c})
    colors = collection_colors(collections)
    tree: dict[str, Any] = {"": [], "children": {}}   # module tree: nodes here, sub-modules
    for node in ids:
        scope = tree
        module = graph.nodes[node].get("module", "")
        for part in module.split("/") if module else ():
            scope = scope["children"].setdefault(part, {"": [], "children": {}})
        scope[""].append(node)

    lines = [f"digraph {_quote(name)} {{", '  rankdir=LR; fontname="Helvetica";',
             '  node [fontname="Helvetica", style=filled];',
             '  edge [fontname="Helvetica", arrowsize=0.7];']
    counter = iter(range(len(ids) + 1))

    def emit(scope: dict, indent: str) -> None:
        for node in scope[""]:
            data = graph.nodes[node]
            kind = data.get("kind")
            fill = {"rng": _RNG_FILL, "output": _OUTPUT_FILL}.get(
                kind, colors.get(data.get("collection", ""), _OUTPUT_FILL))
            lines.append(f"{indent}{ids[node]} [label={_quote(data.get('label', str(node)))}, "
                         f'{_SHAPE.get(kind, "shape=ellipse")}, fillcolor="{fill}"];')
        for part, child in sorted(scope["children"].items()):
            lines.append(f"{indent}subgraph cluster_{next(counter)} {{")
            lines.append(f"{indent}  label={_quote(part)};")
            emit(child, indent + "  ")
            lines.append(f"{indent}}}")

    emit(tree, "  ")
    for u, v in sorted(graph.edges, key=lambda e: (ids[e[0]], ids[e[1]])):
        lines.append(f"  {ids[u]} -> {ids[v]} [{_EDGE[_edge_kind(graph, u, v)]}];")
    if legend:
        lines += _legend(colors)
    lines.append("}")
    return "\n".join(lines) + "\n"


def _legend(colors: dict[str, str]) -> list[str]:
    """The legend: one plain node holding an HTML-like table (so it takes no part in the
    layout's ranks): the node shapes, the collections in their colours, the edge styles."""
    def row(key: str, text: str, fill: str | None = None) -> str:
        background = f' BGCOLOR="{fill}"' if fill else ""
        return f'<TR><TD{background}>{key}</TD><TD ALIGN="LEFT">{_html(text)}</TD></TR>'

    def line(kind: str, dashes: str) -> str:
        color = re.search(r'color="([^"]+)"', _EDGE[kind])[1]
        return f'<FONT COLOR="{color}"><B>{dashes}</B></FONT>'

    rows = [row("ellipse", "read: a variable's value on entry"), row("bold box", "write"),
            row("diamond", "RNG draw", _RNG_FILL), row("double octagon", "output", _OUTPUT_FILL)]
    rows += [row("", f"collection {c}", fill) for c, fill in colors.items()]
    rows += [row(line("read", "&#9472;&#9472;&#9472;"), "flows to an output"),
             row(line("write", "&#9473;&#9473;&#9473;"), "flows to a write"),
             row(line("rng", "- - - -"), "from an RNG draw")]
    table = ('<TABLE BORDER="0" CELLBORDER="1" CELLSPACING="0" CELLPADDING="3" COLOR="#999999">'
             '<TR><TD COLSPAN="2"><B>legend</B></TD></TR>' + "".join(rows) + "</TABLE>")
    return [f"  legend [shape=plain, style=solid, fontsize=10, label=<{table}>];"]


def _html(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def render(graph: nx.DiGraph, path: str | os.PathLike, format: str | None = None,
           name: str = "dataflow", legend: bool = True) -> Path:
    """Draw ``graph`` to ``path`` in ``format`` (default: the one its suffix names); returns
    the path written.

    Missing parent folders are created.  ``.dot``/``.gv`` write the DOT text; other formats
    (``.svg``, ``.png``, ``.pdf``...) go through Graphviz, and raise ``MissingDependencyError``
    if the ``graphviz`` package or the ``dot`` program is missing.
    """
    path = Path(path)
    fmt = (format or path.suffix[1:]).lower()
    if not fmt:
        raise ValueError(f"cannot tell the picture format of {str(path)!r}: give the file a "
                         "suffix such as .svg, .png, .pdf or .dot")
    text = to_dot(graph, name=name, legend=legend)
    if fmt in _TEXT_SUFFIXES:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return path
    try:
        import graphviz
    except ImportError:
        raise MissingDependencyError(
            f"rendering {path.name} needs the graphviz Python package, which is not installed",
            fix=_INSTALL) from None
    if fmt not in graphviz.FORMATS:
        raise ValueError(f"Graphviz cannot write {fmt!r} files ({path.name}); use .svg, .png, "
                         ".pdf or .dot")
    try:
        picture = graphviz.Source(text).pipe(format=fmt)
    except graphviz.ExecutableNotFound:
        raise MissingDependencyError(
            f"rendering {path.name} needs Graphviz's dot program, which is not on the PATH",
            fix=_INSTALL) from None
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(picture)
    return path


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'

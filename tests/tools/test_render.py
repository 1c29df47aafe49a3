"""Pictures of the dataflow graph (varjax.tools.dot): the DOT text's legend and colours, and
``render`` through Graphviz, including the error when Graphviz is missing."""
import re
import shutil
import sys

import jax
import jax.numpy as jnp
import pytest

import varjax as vj
from varjax.errors import MissingDependencyError
from varjax.tools.dot import collection_colors, render

ONES = jax.nn.initializers.ones
X = jnp.ones((2,), jnp.float32)


def counted(x):
    """Reads params, reads and writes a stats variable, and draws from an RNG stream."""
    w = vj.param("w", ONES, (2,))
    n = vj.variable("stats", "n", jnp.zeros, (2,))
    n.value = n.value + w
    return x * w + jax.random.normal(vj.make_rng("dropout"), x.shape)


@pytest.fixture
def graph():
    fz = vj.functionalize(counted)
    rngs = {"params": jax.random.key(0), "dropout": jax.random.key(1)}
    variables = fz.init(rngs, X)
    return vj.dataflow(fz, X, variables=variables, mutable=["stats"], rngs=rngs)


def node_line(dot: str, label: str, shape: str) -> str:
    (line,) = [ln for ln in dot.splitlines() if f'label="{label}"' in ln and shape in ln]
    return line


def test_dot_colours_nodes_by_collection_and_edges_by_kind_with_a_legend(graph):
    dot = graph.to_dot()
    colors = collection_colors(["params", "stats"])
    assert colors["params"] != colors["stats"]
    # Fill colour is the collection; shape is the kind (a read and a write share a label).
    assert f'fillcolor="{colors["params"]}"' in node_line(dot, "params:w", "ellipse")
    assert f'fillcolor="{colors["stats"]}"' in node_line(dot, "stats:n", "ellipse")
    assert f'fillcolor="{colors["stats"]}"' in node_line(dot, "stats:n", "box")
    assert "diamond" in node_line(dot, "rng:dropout", "diamond")
    edges = [ln for ln in dot.splitlines() if "->" in ln]
    assert len(edges) == graph.number_of_edges()
    assert sum("style=dashed" in e for e in edges) == 1            # rng:dropout -> output
    assert sum("#c0392b" in e for e in edges) == 2                 # w and n -> write n
    # The legend: the kinds, each collection in its colour, the three edge styles.
    (legend,) = [ln for ln in dot.splitlines() if ln.strip().startswith("legend [")]
    for text in ("read: a variable", "write", "RNG draw", "output", "flows to a write",
                 "flows to an output", "from an RNG draw"):
        assert text in legend
    for collection, color in colors.items():
        assert re.search(f'BGCOLOR="{color}"></TD><TD[^>]*>collection {collection}<', legend)


def test_collection_colours_are_fixed_for_common_names_and_distinct_for_the_rest():
    few = collection_colors(["params", "zeta"])
    many = collection_colors(["params", "batch_stats", "alpha", "beta", "zeta"])
    assert few["params"] == many["params"] and many["batch_stats"] not in (few["params"],)
    assert len({many[c] for c in ("alpha", "beta", "zeta")}) == 3


def test_dot_suffix_writes_the_text_without_graphviz(graph, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "graphviz", None)    # `import graphviz` fails
    path = graph.render(tmp_path / "flow.gv")
    assert path.read_text() == graph.to_dot()
    assert render(graph, tmp_path / "flow.txt", format="dot").read_text() == graph.to_dot()


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz's dot program is not installed")
@pytest.mark.parametrize("suffix, magic", [("svg", b"<?xml"), ("png", b"\x89PNG")])
def test_render_draws_svg_and_png_through_graphviz(graph, tmp_path, suffix, magic):
    pytest.importorskip("graphviz")
    path = graph.render(tmp_path / f"flow.{suffix}")
    assert path == tmp_path / f"flow.{suffix}" and path.read_bytes().startswith(magic)
    if suffix == "svg":
        text = path.read_text()
        assert "params:w" in text and "legend" in text and "collection stats" in text


def test_missing_graphviz_package_is_a_clear_error(graph, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "graphviz", None)
    with pytest.raises(MissingDependencyError, match="graphviz Python package") as info:
        graph.render(tmp_path / "flow.svg")
    assert "pip install graphviz" in info.value.fix and "apt install graphviz" in info.value.fix
    assert isinstance(info.value, ImportError) and not (tmp_path / "flow.svg").exists()


def test_missing_dot_program_is_a_clear_error(graph, tmp_path, monkeypatch):
    pytest.importorskip("graphviz")
    monkeypatch.setenv("PATH", str(tmp_path))    # no `dot` to run
    with pytest.raises(MissingDependencyError, match="dot program") as info:
        graph.render(tmp_path / "flow.png")
    assert "pip install graphviz" in info.value.fix


@pytest.mark.parametrize("name, message", [("flow", "cannot tell the picture format"),
                                           ("flow.docx", "Graphviz cannot write 'docx'")])
def test_unknown_format_is_refused(graph, tmp_path, name, message):
    pytest.importorskip("graphviz")
    with pytest.raises(ValueError, match=message):
        graph.render(tmp_path / name)

"""The variable dataflow graph (varjax.tools.dataflow): edges through nested bodies, the
unreachable-params analysis, and the DOT text."""
import jax
import jax.numpy as jnp
import pytest

import varjax as vj
from varjax import nn
from varjax.tools.dataflow import dataflow, dead_params, to_dot, unreachable

ONES = jax.nn.initializers.ones
X = jnp.ones((2,), jnp.float32)


def R(collection, *path):
    return ("read", collection, path)


def W(collection, *path):
    return ("write", collection, path)


OUT = ("output", 0)


def graph_of(fn, *args, mutable=False, rngs=None):
    """Initialize ``fn`` and build its dataflow graph for an ``apply`` with ``mutable``."""
    fz = vj.functionalize(fn)
    variables = fz.init({"params": jax.random.key(0), **(rngs or {})}, *args)
    return dataflow(fz, *args, variables=variables, mutable=mutable, rngs=rngs)


def test_straight_line_read_feeds_output_and_write_with_node_attributes():
    def fn(x):
        w = vj.param("w", ONES, (2,))
        b = vj.param("b", ONES, (2,))
        vj.variable("stats", "last", jnp.zeros, (2,)).value = w * x
        return x + b

    g = graph_of(fn, X, mutable=["stats"])
    assert set(g.edges) == {(R("params", "w"), W("stats", "last")), (R("params", "b"), OUT)}
    assert g.nodes[R("params", "w")] == dict(kind="read", collection="params", path=("w",),
                                              module="", label="params:w")
    assert g.nodes[OUT]["kind"] == "output"


def test_counter_increment_links_read_to_write_of_the_same_variable():
    def fn(x):
        n = vj.variable("stats", "n", jnp.zeros, (), jnp.int32)
        n.value += 1
        return x

    g = graph_of(fn, X, mutable=["stats"])
    assert set(g.edges) == {(R("stats", "n"), W("stats", "n"))}


def test_value_written_then_read_back_links_its_sources_not_the_read_node():
    def fn(x):
        s = vj.variable("stats", "s", jnp.zeros, (2,))
        s.value = vj.param("w", ONES, (2,))
        return s.value * x

    g = graph_of(fn, X, mutable=["stats"])
    assert (R("params", "w"), OUT) in g.edges
    assert g.out_degree(R("stats", "s")) == 0  # the value given on entry is never observed


def test_reads_inside_jit_and_checkpoint_feed_the_outer_output_and_writes():
    @jax.checkpoint
    def store(y):
        vj.variable("stats", "y", jnp.zeros, (2,)).value = y
        return y

    def fn(x):
        store(jax.jit(lambda x: x * vj.param("w", ONES, (2,)))(x))
        return jax.jit(lambda x: x + vj.param("b", ONES, (2,)))(x)

    g = graph_of(fn, X, mutable=["stats"])
    assert set(g.edges) == {(R("params", "w"), W("stats", "y")), (R("params", "b"), OUT)}


def test_reads_inside_custom_jvp_and_custom_vjp_primals_feed_the_output():
    @jax.custom_jvp
    def scaled(x):
        return x * vj.param("c", ONES, (2,))
    scaled.defjvp(lambda primals, tangents: (scaled(*primals), tangents[0]))

    @jax.custom_vjp
    def shifted(x):
        return x + vj.param("d", ONES, (2,))
    shifted.defvjp(lambda x: (shifted(x), None), lambda _, g: (g,))

    g = graph_of(lambda x: scaled(x) * shifted(x), X)
    assert set(g.edges) == {(R("params", "c"), OUT), (R("params", "d"), OUT)}


def test_scan_write_at_step_i_feeds_read_at_step_i_plus_1():
    def fn(x):
        h = vj.variable("stats", "h", jnp.zeros, (2,))
        a = vj.param("a", ONES, (2,))

        def body(c, _):
            seen = h.value
            h.value = a
            return c + seen, None
        return jax.lax.scan(body, x, None, length=2)[0]

    g = graph_of(fn, X, mutable=["stats"])
    assert (R("stats", "h"), OUT) in g.edges  # step 0 sees the given value
    assert (R("params", "a"), OUT) in g.edges  # later steps see what step i wrote
    assert (R("params", "a"), W("stats", "h")) in g.edges


def test_scan_carry_fixpoint_reaches_a_value_two_steps_away():
    def fn(x):
        b = vj.param("b", ONES, (2,))

        def body(c, _):
            first, second = c
            return (second, b), None
        return jax.lax.scan(body, (x, x), None, length=3)[0][0]

    assert (R("params", "b"), OUT) in graph_of(fn, X).edges


def test_cond_unions_branches_and_the_predicate_feeds_outputs_and_writes():
    def fn(x):
        q = vj.param("q", ONES, ())
        hits = vj.variable("stats", "hits", jnp.zeros, (2,))
        if vj.is_initializing():  # create the params outside the branches
            vj.param("p1", ONES, (2,)), vj.param("p2", ONES, (2,))

        def yes(x):
            hits.value = x
            return x * vj.param("p1", ONES, (2,))

        def no(x):
            return x * vj.param("p2", ONES, (2,))
        return jax.lax.cond(q > 0, yes, no, x)

    g = graph_of(fn, X, mutable=["stats"])
    assert {(R("params", p), OUT) for p in ("q", "p1", "p2")} <= set(g.edges)
    assert (R("params", "q"), W("stats", "hits")) in g.edges
    assert (R("params", "p1"), W("stats", "hits")) not in g.edges


def test_while_predicate_and_body_reads_feed_the_carry():
    def fn(x):
        limit = vj.param("limit", ONES, ())
        vj.param("step", ONES, (2,))
        return jax.lax.while_loop(lambda c: jnp.sum(c) < limit,
                                  lambda c: c + vj.param("step", ONES, (2,)), x)

    g = graph_of(fn, X)
    assert {(R("params", "limit"), OUT), (R("params", "step"), OUT)} <= set(g.edges)


def test_rng_draw_is_a_source_node():
    def fn(x):
        return x + jax.random.normal(vj.make_rng("dropout"), x.shape)

    g = graph_of(fn, X, rngs={"dropout": jax.random.key(1)})
    assert set(g.edges) == {(("rng", "dropout"), OUT)}
    assert g.nodes[("rng", "dropout")]["label"] == "rng:dropout"


class TwoLayers(nn.Module):
    def setup(self):
        self.first = nn.Dense(3)
        self.second = nn.Dense(2)
        self.unused = nn.Dense(2)

    def __call__(self, x):
        self.unused(x)  # computed, then dropped: read but reaches nothing
        return self.second(self.first(x))

    def skip_unused(self, x):
        return self.second(self.first(x))


def test_module_unused_dense_is_reported_by_unreachable_and_dead_params():
    x = jnp.ones((1, 2), jnp.float32)
    model = TwoLayers()
    variables = model.init(jax.random.key(0), x)
    g = dataflow(model, x, variables=variables)
    assert g.nodes[R("params", "first", "kernel")]["module"] == "first"
    assert unreachable(g) == [("unused", "bias"), ("unused", "kernel")]
    assert unreachable(g, "batch_stats") == []
    # Given but never read at all (a method that never calls the layer).
    assert dead_params(model.skip_unused, x, variables=variables) == [("unused", "bias"),
                                                                      ("unused", "kernel")]


def test_dot_text_is_structurally_valid_and_clusters_modules():
    x = jnp.ones((1, 2), jnp.float32)
    model = TwoLayers()
    g = dataflow(model, x, variables=model.init(jax.random.key(0), x))
    dot = to_dot(g, legend=False)
    assert dot.startswith("digraph")
    assert dot.count("{") == dot.count("}")
    assert all(f'"{label}"' in dot for _, label in g.nodes(data="label"))
    assert dot.count("subgraph cluster_") == 3
    assert dot.count("->") == g.number_of_edges()
    assert "legend" not in dot and to_dot(g) == g.to_dot() != dot


def test_bad_target_type_raises_a_clear_error():
    with pytest.raises(TypeError, match="cannot inspect a int"):
        dataflow(42, X)

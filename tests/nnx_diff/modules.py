"""Random small NNX modules, one source for ``flax.nnx`` and ``varjax.nnx``.

A *spec* (``Spec``) describes a tree of ``nnx.Module`` classes (``Node``), each building its
children in ``__init__(self, rngs)`` and threading one float32 activation ``h`` through them in
``__call__``.  The ops:

* layers ``Linear`` / ``Conv`` (1-d, over the second-to-last axis) / ``LayerNorm`` /
  ``BatchNorm`` / ``Dropout``, and activations;
* ``Counter``: a ``Count`` Variable (a user-defined ``nnx.Variable`` subclass, so a
  collection of its own) incremented in ``__call__`` and mixed back into ``h``;
* ``Seq``: an ``nnx.List`` of layers (not activations: a list holds modules) applied in order;
* ``Sub``: a child module; ``Shared``: one child module object held at two attributes and
  called through both (NNX's graph has one node at two paths).

Widths are tracked while generating: the input is ``(B, L, F)`` and the root ends at width
``F`` (so that a loop can carry its output as its input); a shared child gives back
its input width (it is called twice in a row).  ``build(nnx, spec)`` writes the classes
against the ``nnx`` namespace it is given: the same code runs under ``flax.nnx`` and
``varjax.nnx``.  ``Spec.transforms`` names the transform stack around the forward, innermost
first (the test builds it).

``Spec.mode`` is one of NNX's three modes (``MODES``: the ``graph``/``graph_updates``
switches) both libraries run the example in, and ``Spec.keywords`` how it is set: each
transform given ``graph=``/``graph_updates=``, or ``nnx.set_graph_mode(False)`` /
``nnx.set_graph_updates(False)`` around the whole example.  A tree-mode spec has no shared
child: both libraries refuse one (a hand-written spec of the test checks that).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Union

import jax
import jax.numpy as jnp
from hypothesis import strategies as st

MAX_DEPTH = 2          # module nesting below the root
MAX_TRANSFORMS = 2     # transforms nested around the forward
TRANSFORMS = ("jit", "grad", "value_and_grad", "vmap", "cond", "fori_loop", "remat",
              "switch", "while_loop", "grad_of_both")
GRADS = ("grad", "value_and_grad", "grad_of_both")
LOOPS = ("fori_loop", "while_loop")    # carry the forward's output as its input
# name -> (graph, graph_updates): graph mode with graph updates (flax.nnx's default), graph
# mode without them (only Variable values come back), tree mode (objects are pytrees).
MODES = {"graph": (True, True), "no_updates": (True, False), "tree": (False, False)}


@dataclass(frozen=True)
class Linear:
    din: int
    dout: int
    use_bias: bool = True


@dataclass(frozen=True)
class Conv:
    din: int
    dout: int
    kernel: int


@dataclass(frozen=True)
class LayerNorm:
    din: int


@dataclass(frozen=True)
class BatchNorm:
    din: int
    momentum: float


@dataclass(frozen=True)
class Dropout:
    rate: float


@dataclass(frozen=True)
class Act:
    name: str


@dataclass(frozen=True)
class Counter:
    pass


@dataclass(frozen=True)
class Seq:
    layers: tuple


@dataclass(frozen=True)
class Sub:
    node: "Node"


@dataclass(frozen=True)
class Shared:
    node: "Node"


Op = Union[Linear, Conv, LayerNorm, BatchNorm, Dropout, Act, Counter, Seq, Sub, Shared]


@dataclass(frozen=True)
class Node:
    name: str
    ops: tuple


@dataclass(frozen=True)
class Spec:
    root: Node
    shape: tuple       # (B, L, F)
    seed: int
    transforms: tuple  # innermost first
    mode: str = "graph"        # a key of MODES
    keywords: bool = False     # the mode as each transform's keywords, not a setting around


def walk_ops(node: Node):
    for op in node.ops:
        yield op
        if isinstance(op, (Sub, Shared)):
            yield from walk_ops(op.node)
        elif isinstance(op, Seq):
            yield from op.layers


def format_spec(spec: Spec) -> str:
    return (f"Spec(shape={spec.shape}, seed={spec.seed}, transforms={spec.transforms},\n"
            f"     mode={spec.mode!r}, keywords={spec.keywords},\n     root={spec.root!r})")


# --- generation ----------------------------------------------------------------------------

_LAYERS = ("linear", "conv", "layernorm", "batchnorm", "dropout", "act")
_CHILDREN = ("sub", "shared")


def _layer(draw, kind: str, w: int):
    """One leaf layer at input width ``w``: ``(op, output width)``."""
    if kind == "linear":
        out = draw(st.integers(2, 4))
        return Linear(w, out, draw(st.booleans())), out
    if kind == "conv":
        out = draw(st.integers(2, 4))
        return Conv(w, out, draw(st.sampled_from((1, 2, 3)))), out
    if kind == "layernorm":
        return LayerNorm(w), w
    if kind == "batchnorm":
        return BatchNorm(w, draw(st.sampled_from((0.5, 0.9, 0.99)))), w
    if kind == "dropout":
        return Dropout(draw(st.sampled_from((0.0, 0.5)))), w
    return Act(draw(st.sampled_from(("relu", "tanh", "gelu")))), w


@dataclass(frozen=True)
class _Rules:
    """What a spec's modules may hold: shared children, integer Variables (a counter, a
    Dropout's stream), up to ``max_ops`` ops per module."""
    shared: bool
    ints: bool
    max_ops: int


def _node(draw, w: int, depth: int, counter: list, out_width: int | None,
          rules: _Rules) -> tuple[Node, int]:
    counter[0] += 1
    name = f"Block{counter[0]}" if depth else "Model"
    ops, n = [], draw(st.integers(1, rules.max_ops))
    for _ in range(n):
        children = (_CHILDREN if rules.shared else ("sub",)) if depth < MAX_DEPTH else ()
        kinds = _LAYERS + ("counter", "seq") + children
        if not rules.ints:
            kinds = tuple(k for k in kinds if k not in ("counter", "dropout"))
        kind = draw(st.sampled_from(kinds))
        if kind == "counter":
            ops.append(Counter())
        elif kind == "seq":
            layers = []
            for _ in range(draw(st.integers(1, 3))):
                listed = [k for k in kinds if k in _LAYERS and k != "act"]
                op, w = _layer(draw, draw(st.sampled_from(listed)), w)
                layers.append(op)
            ops.append(Seq(tuple(layers)))
        elif kind == "sub":
            node, w = _node(draw, w, depth + 1, counter, None, rules)
            ops.append(Sub(node))
        elif kind == "shared":
            node, w = _node(draw, w, depth + 1, counter, w, rules)
            ops.append(Shared(node))
        else:
            op, w = _layer(draw, kind, w)
            ops.append(op)
    if out_width is not None and w != out_width:
        ops.append(Linear(w, out_width))
        w = out_width
    return Node(name, tuple(ops)), w


def _transforms(draw) -> tuple:
    """Innermost first.  A gradient at most once; a loop carries the forward's output as its
    input, so not around a gradient."""
    stack: list = []
    for _ in range(draw(st.integers(0, MAX_TRANSFORMS))):
        graded = any(k in GRADS for k in stack)
        allowed = [k for k in TRANSFORMS if not (graded and k in GRADS + LOOPS)]
        stack.append(draw(st.sampled_from(allowed)))
    return tuple(stack)


def _drawn_modes() -> tuple:
    """``VARJAX_NNX_MODES`` (comma-separated keys of ``MODES``) restricts a long run to some
    modes; by default all three are drawn."""
    names = tuple(n for n in os.environ.get("VARJAX_NNX_MODES", ",".join(MODES)).split(",") if n)
    unknown = [n for n in names if n not in MODES]
    if unknown or not names:
        raise ValueError(f"VARJAX_NNX_MODES: {unknown or names} not among {tuple(MODES)}")
    return names


@st.composite
def specs(draw, max_ops: int = 4) -> Spec:
    """A spec with up to ``max_ops`` ops per module (the suite's fixed examples draw fewer
    than a long run: their time is the suite's)."""
    mode = draw(st.sampled_from(_drawn_modes()))
    transforms = _transforms(draw)
    shape = (draw(st.integers(2, 3)), draw(st.integers(2, 3)), draw(st.integers(2, 3)))
    # Without graph updates a gradient is of whole modules, and both libraries refuse an
    # integer Variable there (a counter, a Dropout's stream count: jax.grad's TypeError,
    # hand-written "whole_module_grad_of_an_integer_variable"), so such modules are not
    # drawn there: every example would be refused.
    whole = not MODES[mode][1] and bool(set(GRADS) & set(transforms))
    rules = _Rules(shared=MODES[mode][0], ints=not whole, max_ops=max_ops)
    root, _ = _node(draw, shape[-1], 0, [0], shape[-1], rules)
    return Spec(root, shape, draw(st.integers(0, 2**16)), transforms, mode, draw(st.booleans()))


# --- building ------------------------------------------------------------------------------

def build(nnx, spec_or_node) -> type:
    """The root class of the spec, written against ``nnx`` (``flax.nnx`` or ``varjax.nnx``)."""
    node = spec_or_node.root if isinstance(spec_or_node, Spec) else spec_or_node
    count = type("Count", (nnx.Variable,), {"__doc__": "A call counter: a collection of its own."})
    return _Builder(nnx, count).cls(node)


_ACTS = {"relu": jax.nn.relu, "tanh": jnp.tanh, "gelu": jax.nn.gelu}


class _Builder:
    def __init__(self, nnx, count: type):
        self.nnx, self.count, self.classes = nnx, count, {}

    def layer(self, op, rngs):
        nnx = self.nnx
        if isinstance(op, Linear):
            return nnx.Linear(op.din, op.dout, use_bias=op.use_bias, rngs=rngs)
        if isinstance(op, Conv):
            return nnx.Conv(op.din, op.dout, kernel_size=(op.kernel,), rngs=rngs)
        if isinstance(op, LayerNorm):
            return nnx.LayerNorm(op.din, rngs=rngs)
        if isinstance(op, BatchNorm):
            return nnx.BatchNorm(op.din, momentum=op.momentum, rngs=rngs)
        if isinstance(op, Dropout):
            return nnx.Dropout(op.rate, rngs=rngs)
        if isinstance(op, Counter):
            return self.count(jnp.zeros((), jnp.int32))
        if isinstance(op, Seq):
            return nnx.List([self.layer(layer, rngs) for layer in op.layers])
        if isinstance(op, (Sub, Shared)):
            return self.cls(op.node)(rngs)
        return None

    def cls(self, node: Node) -> type:
        if node.name in self.classes:
            return self.classes[node.name]
        builder, ops = self, node.ops

        def __init__(self, rngs):
            for i, op in enumerate(ops):
                made = builder.layer(op, rngs)
                if made is not None:
                    setattr(self, f"op{i}", made)
                    if isinstance(op, Shared):
                        setattr(self, f"op{i}_again", made)

        def __call__(self, h):
            for i, op in enumerate(ops):
                if isinstance(op, Act):
                    h = _ACTS[op.name](h)
                elif isinstance(op, Counter):
                    c = getattr(self, f"op{i}")
                    c[...] = c[...] + 1
                    h = h + 0.1 * c[...].astype(h.dtype)
                elif isinstance(op, Seq):
                    for layer in getattr(self, f"op{i}"):
                        h = layer(h)
                elif isinstance(op, Shared):
                    h = getattr(self, f"op{i}_again")(getattr(self, f"op{i}")(h))
                else:
                    h = getattr(self, f"op{i}")(h)
            return h

        made = type(node.name, (self.nnx.Module,), {"__init__": __init__, "__call__": __call__})
        self.classes[node.name] = made
        return made

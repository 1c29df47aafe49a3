"""Random small Linen-style modules, one source for ``flax.linen`` and ``varjax.nn``.

A *spec* (``Spec``) describes a tree of module classes (``Node``), each written in ``setup``
or ``@compact`` style, whose ``__call__`` threads one float32 activation ``h`` through a list
of ops:

* leaf layers ``Dense`` / ``Conv`` / ``BatchNorm`` / ``LayerNorm`` / ``Dropout``, activations,
  a ``self.param`` scale vector;
* ``Sow`` into ``intermediates`` (Linen's default tuple reduction, or an additive one);
* ``Counter``: an in-place ``self.variable`` update (an int32 call counter, or a float running
  mean of ``h``) whose value is mixed back into ``h``;
* ``Sub``: a child module, bare or wrapped in a lifted ``remat`` / ``jit`` / ``vmap`` / ``scan``
  with their variable options;
* ``Cond`` / ``While``: ``nn.cond`` / ``nn.while_loop`` over child modules.

Lifted transforms nest at most ``MAX_LIFTS`` deep.  ``build(nn, spec)`` turns the spec into
module classes written against the ``nn`` namespace it is given, so the *same* code runs
under ``flax.linen`` and ``varjax.nn``: the only thing that differs is the library.

Shapes are tracked while generating: the input is ``(B, L, F)``; ``vmap`` and ``scan`` drop
one axis for their body; ``Conv`` and ``BatchNorm`` need rank >= 2.  Bodies that must give
back their input shape (scan steps, cond branches, while bodies) end with a ``Dense`` back
to the input width when theirs changed, and never permute axes.

Every generated class has one field, ``train``: ``Dropout`` is ``deterministic=not train``.

A spec may name a shipped pass (``PassUse``) given to varjax's ``init`` and ``apply``.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Union

import jax
import jax.numpy as jnp
from hypothesis import strategies as st

MAX_LIFTS = 2        # lifted transforms (remat/jit/vmap/scan/cond/while_loop) nested at most this deep
MAX_NODES_DEPTH = 3  # module nesting depth below the root, bare children included
COUNTER_COLS = ("counter", "stats")
POLICIES = {None: None, "nothing": "nothing_saveable", "everything": "everything_saveable",
            "dots": "dots_saveable"}


# --- the spec ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Dense:
    features: int
    use_bias: bool = True


@dataclass(frozen=True)
class Conv:
    """1-d ``Conv`` over the second-to-last axis, ``padding='SAME'``."""
    features: int
    kernel: int
    use_bias: bool = True


@dataclass(frozen=True)
class BatchNorm:
    """``use_running_average``: ``True``, ``False`` or ``'auto'``, Linen's idiom
    ``not self.is_mutable_collection('batch_stats')``.  ``as_arg``: given to the call rather
    than to the constructor.  ``axis_name``: the statistics are averaged over the members of
    the enclosing ``vmap`` of that ``axis_name``."""
    use_running_average: Union[bool, str]
    momentum: float = 0.9
    as_arg: bool = False
    axis_name: str | None = None


@dataclass(frozen=True)
class LayerNorm:
    use_bias: bool = True
    use_scale: bool = True


@dataclass(frozen=True)
class Dropout:
    """``deterministic=not self.train``, given to the constructor or (``as_arg``) the call."""
    rate: float
    as_arg: bool = False


@dataclass(frozen=True)
class Act:
    fn: str   # 'relu' | 'tanh'


@dataclass(frozen=True)
class Param:
    """``w = self.param(name, normal, (width,))``; ``h = h * w``."""
    name: str
    width: int


@dataclass(frozen=True)
class Sow:
    """``self.sow('intermediates', ...)`` of ``h`` (tuple, Linen's default reduction) or of
    ``mean(h)`` (additive).  The returned bool is folded into ``h``."""
    name: str
    add: bool


@dataclass(frozen=True)
class Counter:
    """``kind='int'``: an int32 call counter, ``h = h * (1 + 0.1 * n)``.
    ``kind='float'``: a running mean ``m = 0.5 * m + 0.5 * mean(h)``, ``h = h + m``.
    ``kind='put'``: the int counter through ``has_variable`` / ``get_variable`` /
    ``put_variable`` (in ``__call__`` also in setup style)."""
    col: str
    name: str
    kind: str


@dataclass(frozen=True)
class Lift:
    """A lifted transform and its options (a sorted tuple of ``(name, value)``; dict-valued
    options are tuples of pairs too, so specs stay hashable)."""
    kind: str    # 'remat' | 'jit' | 'vmap' | 'scan' ('region': raw jax.jit, see strip_lifts)
    options: tuple = ()
    form: str = "class"   # 'class': nn.jit(Cls); 'method': decorates Cls.__call__; 'fn': a function
                          # taking the module first, nn.jit(lambda mdl, h: mdl(h))(child, h)

    def kwargs(self) -> dict:
        return {k: dict(v) if k in ("variable_axes", "split_rngs") else
                (list(v) if isinstance(v, tuple) else v) for k, v in self.options}


@dataclass(frozen=True)
class Sub:
    """A child module: ``node``'s class, wrapped in ``lift`` if any.  ``name`` is an explicit
    ``name=`` (compact style) or ``None`` for the automatic one."""
    node: "Node"
    lift: Lift | None = None
    name: str | None = None


@dataclass(frozen=True)
class Cond:
    """``h = nn.cond(sum(h) > 0, true_fn, false_fn, self, h)``.  ``true_fn`` calls child ``a``;
    ``false_fn`` calls child ``b``, or ``a`` again (``b='shared'``), or ``-a(h)`` (``'neg'``).

    With ``pre_init``, ``init`` first calls the children outside the cond, so that the
    branches create no variables (Linen needs every branch to create the same ones)."""
    a: "Node"
    b: Union["Node", str]
    pre_init: bool = False


@dataclass(frozen=True)
class While:
    """``nn.while_loop`` over ``(i, h)``, ``n`` iterations of ``h = child(h)``.  At init the
    body runs once directly (the loop may not create variables), as Linen's docs show."""
    node: "Node"
    n: int
    carry: tuple          # carry_variables
    broadcast: tuple      # broadcast_variables (empty: the default, every collection)
    split_dropout: bool | None = None   # split_rngs={'dropout': ...}, when given


@dataclass(frozen=True)
class Reuse:
    """Calls the module op ``index`` of the same method made again (shared weights);
    ``op`` is that op, for the builder."""
    index: int
    op: Union[Dense, Conv, BatchNorm, LayerNorm, Sub] = dataclasses.field(repr=False)


Op = Union[Dense, Conv, BatchNorm, LayerNorm, Dropout, Act, Param, Sow, Counter, Sub, Cond, While, Reuse]


@dataclass(frozen=True)
class Node:
    """One module class.  ``style`` is ``'compact'`` or ``'setup'``; ``setup_list`` keeps the
    setup-built submodules in one list attribute (``layers_0``, ...) instead of one attribute
    each.  A ``scan_body`` node is called as ``(c, x) -> (h, h)`` with ``h = c + x`` first."""
    cls_name: str
    style: str
    ops: tuple
    scan_body: bool = False
    setup_list: bool = False


PASSES = ("lora", "cast-params", "fake-quant", "stop-gradient", "tie")


@dataclass(frozen=True)
class PassUse:
    """A shipped pass given to varjax's ``init`` and ``apply`` (``passes=``).  ``options`` are
    the pass's own, as pairs; ``pick`` chooses what the model only names once it is built:
    the module path of ``stop-gradient``'s ``under``, the two kernels ``tie`` ties."""
    kind: str
    options: tuple = ()
    pick: int = 0


@dataclass(frozen=True)
class Spec:
    root: Node
    shape: tuple          # input shape (B, L, F)
    seed: int
    mutable: tuple        # ('list', cols) | ('all',) | ('deny', cols): the compared apply's mutable
    drop: tuple = ()      # mutable collections left out of the variables: apply re-creates them
    passes: PassUse | None = None

    def __str__(self) -> str:
        return format_spec(self)


# --- walking the spec ----------------------------------------------------------------------

def child_nodes(op) -> list[Node]:
    if isinstance(op, (Sub, While)):
        return [op.node]
    if isinstance(op, Cond):
        return [op.a] + ([op.b] if isinstance(op.b, Node) else [])
    return []


def walk_ops(node: Node):
    for op in node.ops:
        yield op
        for child in child_nodes(op):
            yield from walk_ops(child)


def usage(node: Node) -> dict[str, str]:
    """``{collection: 'read' | 'maybe' | 'write'}`` of everything ``node``'s subtree touches:
    ``'maybe'`` is written when mutable (a ``sow``, an ``'auto'`` ``BatchNorm``)."""
    out: dict[str, str] = {}
    rank = {"read": 0, "maybe": 1, "write": 2}

    def add(col, mode):
        if rank[mode] > rank.get(out.get(col), -1):
            out[col] = mode
    for op in walk_ops(node):
        if isinstance(op, (Dense, Conv, LayerNorm, Param)):
            if not (isinstance(op, LayerNorm) and not (op.use_bias or op.use_scale)):
                add("params", "read")
        elif isinstance(op, BatchNorm):
            add("params", "read")
            add("batch_stats", {True: "read", False: "write"}.get(op.use_running_average, "maybe"))
        elif isinstance(op, Sow):
            add("intermediates", "maybe")
        elif isinstance(op, Counter):
            add(op.col, "write")
    return out


def uses_dropout(node: Node) -> bool:
    return any(isinstance(op, Dropout) and op.rate > 0 for op in walk_ops(node))


def has_op(node: Node, kind) -> bool:
    return any(isinstance(op, kind) for op in walk_ops(node))


def lifts(node: Node) -> set[str]:
    out = set()
    for op in walk_ops(node):
        if isinstance(op, Sub) and op.lift is not None:
            out.add(op.lift.kind)
        elif isinstance(op, Cond):
            out.add("cond")
        elif isinstance(op, While):
            out.add("while_loop")
    return out


def format_spec(spec: Spec) -> str:
    lines = [f"Spec(shape={spec.shape}, seed={spec.seed}, mutable={spec.mutable}, drop={spec.drop}"
             + (f", passes={spec.passes}" if spec.passes else "") + ")"]

    def fmt_node(node: Node, indent: int, head: str) -> None:
        pad = "  " * indent
        extra = (", scan_body" if node.scan_body else "") + (", setup_list" if node.setup_list else "")
        lines.append(f"{pad}{head}class {node.cls_name} ({node.style}{extra}):")
        for op in node.ops:
            if isinstance(op, Sub):
                lift = "" if op.lift is None else f"{op.lift.kind}[{op.lift.form}]({op.lift.kwargs()}) "
                fmt_node(op.node, indent + 1, f"Sub {lift}name={op.name!r}: ")
            elif isinstance(op, Cond):
                fmt_node(op.a, indent + 1, f"Cond pre_init={op.pre_init} true: ")
                if isinstance(op.b, Node):
                    fmt_node(op.b, indent + 1, "Cond false: ")
                else:
                    lines.append(f"{pad}  Cond false: {op.b}")
            elif isinstance(op, While):
                fmt_node(op.node, indent + 1, f"While n={op.n} carry={op.carry} broadcast={op.broadcast} "
                         f"split_dropout={op.split_dropout}: ")
            else:
                lines.append(f"{pad}  {op!r}")
    fmt_node(spec.root, 1, "")
    return "\n".join(lines)


def strip_lifts(node: Node, kinds: tuple, region: bool = False) -> Node:
    """``node`` with the lifts of ``kinds`` taken off its children where that keeps every
    variable's path: a lifted *class* is named after the lift (``CheckpointCell_0``) when
    compact code names it automatically, so those stay.  For ``remat`` and ``jit`` the result
    computes the same function: the "unrolled" model a pass is checked against.

    With ``region``, each lift taken off leaves a plain ``jax.jit`` around the child's call
    (``Lift('region', form='fn')``): the same code in a region of raw JAX, where a pass that
    makes region edges keep their declared dtypes (``cast-params``) rounds as at the lift."""
    def strip(op):
        if isinstance(op, Sub):
            keep = op.lift is None or op.lift.kind not in kinds or (
                op.lift.form == "class" and node.style == "compact" and op.name is None)
            left = Lift("region", form="fn") if region else None
            return Sub(strip_lifts(op.node, kinds, region), op.lift if keep else left, op.name)
        if isinstance(op, Cond):
            b = strip_lifts(op.b, kinds, region) if isinstance(op.b, Node) else op.b
            return Cond(strip_lifts(op.a, kinds, region), b, op.pre_init)
        if isinstance(op, While):
            return dataclasses.replace(op, node=strip_lifts(op.node, kinds, region))
        if isinstance(op, Reuse):
            return Reuse(op.index, strip(op.op))
        return op
    return dataclasses.replace(node, ops=tuple(strip(op) for op in node.ops))


# --- the generator -------------------------------------------------------------------------

@dataclass
class _Ctx:
    """Generation state: how many lifts enclose us, whether we are in a while body (no
    ``sow``: it would create a variable inside the loop), whether axes may be permuted."""
    lifts: int = 0
    depth: int = 0
    in_while: bool = False
    fixed_layout: bool = False
    axis_names: tuple = ()      # of the enclosing vmaps that have one
    names: list = dataclasses.field(default_factory=list)

    def inner(self, **kw) -> "_Ctx":
        return dataclasses.replace(self, depth=self.depth + 1, **kw)


_CLASS_NAMES = ("Block", "Cell", "Unit", "Layer", "Stage", "Head", "Tower", "Core")


def _class_name(draw, ctx: _Ctx) -> str:
    # Mostly fresh names; sometimes a reused one (two different classes with one __name__).
    free = [n for n in _CLASS_NAMES if n not in ctx.names]
    if ctx.names and (not free or draw(st.integers(0, 7)) == 0):
        return draw(st.sampled_from(ctx.names))
    name = draw(st.sampled_from(free))
    ctx.names.append(name)
    return name


def _width(draw) -> int:
    return draw(st.integers(2, 4))


def options(pairs: dict) -> tuple:
    def freeze(v):
        if isinstance(v, dict):
            return tuple(sorted(v.items()))
        if isinstance(v, list):
            return tuple(v)
        return v
    return tuple(sorted((k, freeze(v)) for k, v in pairs.items()))


def _vmap_lift(draw, body: Node, shape: tuple, axis: int) -> Lift:
    use = usage(body)
    axes, split = {}, {}
    if "params" in use:
        bcast = draw(st.booleans())
        axes["params"] = None if bcast else 0
        # Coupled as in the docs most of the time; an uncoupled choice now and then.
        split["params"] = (not bcast) if draw(st.integers(0, 4)) else draw(st.booleans())
    if "batch_stats" in use:
        axes["batch_stats"] = 0 if use["batch_stats"] != "read" else draw(st.sampled_from([0, None]))
    for col in COUNTER_COLS:
        if col in use:
            # A float counter's update depends on the mapped input: it must be mapped.
            batched = any(isinstance(op, Counter) and op.col == col and op.kind == "float"
                          for op in walk_ops(body))
            axes[col] = 0 if batched else draw(st.sampled_from([0, 0, None]))
    if "intermediates" in use:
        axes["intermediates"] = 0
    if uses_dropout(body) or draw(st.booleans()):
        split["dropout"] = draw(st.booleans())
    opts = {"variable_axes": axes, "split_rngs": split, "in_axes": axis, "out_axes": axis}
    if draw(st.booleans()):
        opts["axis_size"] = shape[axis]
    return Lift("vmap", options(opts))


def _scan_lift(draw, body: Node, shape: tuple, axis: int, out_axis: int) -> Lift:
    use = usage(body)
    axes, broadcast, carry, split = {}, [], [], {}
    if "params" in use:
        if draw(st.booleans()):
            axes["params"] = 0
            split["params"] = True if draw(st.integers(0, 4)) else draw(st.booleans())
        else:
            broadcast.append("params")
            split["params"] = False
    if "batch_stats" in use:
        choices = ["carry", "axes", "axes"] + (["broadcast"] if use["batch_stats"] == "read" else [])
        where = draw(st.sampled_from(choices))
        {"carry": carry, "broadcast": broadcast}.get(where, []).append("batch_stats")
        if where == "axes":
            axes["batch_stats"] = 0
    for col in COUNTER_COLS:
        if col in use:
            if draw(st.integers(0, 2)) == 0:
                carry.append(col)
            else:
                axes[col] = 0
    if "intermediates" in use:
        axes["intermediates"] = 0
    if uses_dropout(body) or draw(st.booleans()):
        split["dropout"] = draw(st.booleans())
    opts = {"variable_axes": axes, "split_rngs": split, "in_axes": axis, "out_axes": out_axis}
    # A single-name filter as a string, several as a list; False when there are none.
    for key, cols in (("variable_broadcast", broadcast), ("variable_carry", carry)):
        if cols:
            opts[key] = cols[0] if len(cols) == 1 and draw(st.booleans()) else sorted(cols)
    if draw(st.booleans()):
        opts["length"] = shape[axis]
    if draw(st.integers(0, 3)) == 0:
        opts["reverse"] = True
    if draw(st.integers(0, 3)) == 0:
        opts["unroll"] = 2
    return Lift("scan", options(opts))


def _remat_lift(draw) -> Lift:
    opts = {}
    if draw(st.booleans()):
        opts["prevent_cse"] = draw(st.booleans())
    policy = draw(st.sampled_from(sorted(POLICIES, key=str)))
    if policy is not None:
        opts["policy"] = policy
    return Lift("remat", options(opts))


def _node(draw, shape: tuple, ctx: _Ctx, *, scan_body: bool = False, n_ops=None) -> tuple[Node, tuple]:
    """A node taking ``shape`` and its output shape (``shape`` itself for bodies that must
    preserve it, i.e. when ``ctx.fixed_layout``)."""
    cls_name = _class_name(draw, ctx)
    style = draw(st.sampled_from(["compact", "setup"]))
    n_ops = draw(st.integers(1, 3)) if n_ops is None else n_ops
    ops, out = _ops(draw, shape, ctx, n_ops)
    if ctx.fixed_layout and out[-1] != shape[-1]:
        ops.append(Dense(shape[-1], draw(st.booleans())))
        out = shape
    setup_list = style == "setup" and draw(st.booleans())
    return Node(cls_name, style, tuple(ops), scan_body, setup_list), out


def _form(draw) -> str:
    return draw(st.sampled_from(["class", "class", "method", "fn"]))


def _ops(draw, shape: tuple, ctx: _Ctx, n_ops: int) -> tuple[list, tuple]:
    ops: list = []
    s = shape
    n_counters = n_params = 0
    made: list = []     # (index, op, input shape, output shape) of the module ops so far
    for _ in range(n_ops):
        start = s
        kinds = ["dense", "dense", "act", "layernorm", "param", "counter", "dropout"]
        if len(s) >= 2:
            kinds += ["conv", "batchnorm", "batchnorm"]
        if not ctx.in_while:
            kinds += ["sow"]
        if any(m[2] == s for m in made):
            kinds += ["reuse", "reuse"]
        if ctx.depth < MAX_NODES_DEPTH:
            kinds += ["sub"]
            if ctx.lifts < MAX_LIFTS:
                kinds += ["remat", "jit", "cond", "while"]
                if len(s) >= 2:
                    kinds += ["vmap", "vmap", "scan", "scan"]
        kind = draw(st.sampled_from(kinds))
        if kind == "reuse":
            index, op, _, s = draw(st.sampled_from([m for m in made if m[2] == s]))
            ops.append(Reuse(index, op))
            continue
        if kind == "dense":
            w = s[-1] if ctx.fixed_layout and draw(st.booleans()) else _width(draw)
            ops.append(Dense(w, draw(st.integers(0, 3)) > 0))
            s = s[:-1] + (w,)
        elif kind == "conv":
            w = _width(draw)
            ops.append(Conv(w, draw(st.integers(1, 3)), draw(st.integers(0, 3)) > 0))
            s = s[:-1] + (w,)
        elif kind == "batchnorm":
            ura = draw(st.sampled_from([True, False, "auto"]))
            axis_name = None
            if ctx.axis_names and draw(st.booleans()):
                axis_name = draw(st.sampled_from(ctx.axis_names))
            ops.append(BatchNorm(ura, draw(st.sampled_from([0.9, 0.5])), draw(st.booleans()), axis_name))
        elif kind == "layernorm":
            ops.append(LayerNorm(draw(st.integers(0, 3)) > 0, draw(st.integers(0, 3)) > 0))
        elif kind == "dropout":
            ops.append(Dropout(draw(st.sampled_from([0.0, 0.5])), draw(st.booleans())))
        elif kind == "act":
            ops.append(Act(draw(st.sampled_from(["relu", "tanh"]))))
        elif kind == "param":
            ops.append(Param(f"w{n_params}", s[-1]))
            n_params += 1
        elif kind == "sow":
            ops.append(Sow(draw(st.sampled_from(["a", "b"])), draw(st.booleans())))
        elif kind == "counter":
            ops.append(Counter(draw(st.sampled_from(COUNTER_COLS)), f"n{n_counters}",
                               draw(st.sampled_from(["int", "float", "put"]))))
            n_counters += 1
        elif kind in ("sub", "remat", "jit"):
            node, s = _node(draw, s, ctx.inner(lifts=ctx.lifts + (kind != "sub")))
            lift = None
            if kind == "remat":
                lift = dataclasses.replace(_remat_lift(draw), form=_form(draw))
            elif kind == "jit":
                lift = Lift("jit", form=_form(draw))
            ops.append(Sub(node, lift, _sub_name(draw, ops)))
        elif kind == "vmap":
            axis = draw(st.integers(0, len(s) - 2))
            body_shape = s[:axis] + s[axis + 1:]
            axis_name = f"batch{ctx.depth}" if draw(st.booleans()) else None
            names = ctx.axis_names + ((axis_name,) if axis_name else ())
            node, out = _node(draw, body_shape, ctx.inner(lifts=ctx.lifts + 1, axis_names=names))
            out_axis = axis
            if not ctx.fixed_layout and draw(st.integers(0, 3)) == 0:
                out_axis = draw(st.integers(0, len(out) - 1))
            lift = _vmap_lift(draw, node, s, axis)
            extra = {"out_axes": out_axis} if out_axis != axis else {}
            if axis_name:
                extra["axis_name"] = axis_name
            lift = Lift("vmap", options({**lift.kwargs(), **extra}), _form(draw))
            ops.append(Sub(node, lift, _sub_name(draw, ops)))
            s = out[:out_axis] + (s[axis],) + out[out_axis:]
        elif kind == "scan":
            axis = draw(st.integers(0, len(s) - 2))
            body_shape = s[:axis] + s[axis + 1:]
            node, _ = _node(draw, body_shape, ctx.inner(lifts=ctx.lifts + 1, fixed_layout=True),
                            scan_body=True)
            out_axis = axis if ctx.fixed_layout or draw(st.booleans()) else 0
            lift = dataclasses.replace(_scan_lift(draw, node, s, axis, out_axis), form=_form(draw))
            ops.append(Sub(node, lift, _sub_name(draw, ops)))
            s = body_shape[:out_axis] + (s[axis],) + body_shape[out_axis:]
        elif kind == "cond":
            inner = ctx.inner(lifts=ctx.lifts + 1, fixed_layout=True)
            a, _ = _node(draw, s, inner)
            b = draw(st.sampled_from(["node", "shared", "neg"]))
            if b == "node":
                b, _ = _node(draw, s, inner)
            ops.append(Cond(a, b, isinstance(b, Node) or draw(st.booleans())))
        elif kind == "while":
            node, _ = _node(draw, s, ctx.inner(lifts=ctx.lifts + 1, fixed_layout=True, in_while=True))
            use = usage(node)
            carry = tuple(sorted(c for c, m in use.items() if m != "read"))
            broadcast = tuple(sorted(c for c, m in use.items() if m == "read")) if draw(st.booleans()) else ()
            split = draw(st.sampled_from([None, True, False]))
            ops.append(While(node, draw(st.integers(0, 3)), carry, broadcast, split))
        if isinstance(ops[-1], (Dense, Conv, BatchNorm, LayerNorm, Sub)):
            made.append((len(ops) - 1, ops[-1], start, s))
    return ops, s


def _sub_name(draw, ops) -> str | None:
    return f"sub{len(ops)}" if draw(st.integers(0, 3)) == 0 else None


@st.composite
def specs(draw) -> Spec:
    shape = (draw(st.integers(2, 3)), draw(st.integers(2, 3)), draw(st.integers(2, 3)))
    ctx = _Ctx()
    root, _ = _node(draw, shape, ctx, n_ops=draw(st.integers(1, 4)))
    root = dataclasses.replace(root, cls_name="Model")
    use = usage(root)
    written = sorted(c for c, m in use.items() if m == "write")
    maybe = sorted(c for c, m in use.items() if m == "maybe")
    chosen = [c for c in maybe if draw(st.booleans())]
    cols = sorted(written + chosen)
    how = draw(st.sampled_from(["list", "list", "list", "all", "deny"]))
    if how == "all":
        mutable = ("all",)
    elif how == "deny":
        mutable = ("deny", tuple(["params"] + [c for c in maybe if c not in chosen]))
    else:
        mutable = ("list", tuple(cols))
    # Now and then the applies get the variables without some mutable collections, which
    # they then create (as init did).
    drop = ()
    droppable = [c for c in written + chosen if c != "intermediates"]
    if droppable and draw(st.integers(0, 3)) == 0:
        drop = tuple(sorted(draw(st.sets(st.sampled_from(droppable), min_size=1))))
    passes = _pass_use(draw) if draw(st.integers(0, 2)) == 0 else None
    return Spec(root, shape, draw(st.integers(0, 2**16)), mutable, drop, passes)


def _pass_use(draw) -> PassUse:
    # From a wide integer: hypothesis draws the first of a few choices far more often.
    kind = PASSES[draw(st.integers(0, 2**16)) % len(PASSES)]
    if kind == "lora":
        opts = {"rank": draw(st.integers(1, 2)), "scale": draw(st.sampled_from([1.0, 0.5]))}
    elif kind == "cast-params":
        opts = {"dtype": draw(st.sampled_from(["bfloat16", "float16"]))}
    elif kind == "fake-quant":
        opts = {"bits": draw(st.sampled_from([8, 4, 2])), "per_channel": draw(st.booleans()),
                "min_rank": draw(st.sampled_from([2, 0]))}
    else:
        opts = {}
    return PassUse(kind, options(opts), draw(st.integers(0, 2**16)))


# --- the builder ---------------------------------------------------------------------------

def mutable_arg(nn, spec: Spec):
    """The ``mutable=`` argument of the compared apply, for library ``nn``."""
    if spec.mutable[0] == "all":
        return True
    if spec.mutable[0] == "deny":
        return nn.DenyList(list(spec.mutable[1]))
    return list(spec.mutable[1]) or False


def build(nn, spec_or_node) -> type:
    """The root module class of ``spec_or_node``, written against ``nn``."""
    node = spec_or_node.root if isinstance(spec_or_node, Spec) else spec_or_node
    return _Builder(nn).cls(node)


class _Builder:
    def __init__(self, nn):
        self.nn = nn
        self.classes: dict[Node, type] = {}

    def cls(self, node: Node, method_lift: Lift | None = None) -> type:
        """``node``'s class; with ``method_lift``, its ``__call__`` decorated by that lift."""
        if (node, method_lift) not in self.classes:
            self.classes[node, method_lift] = self._make(node, method_lift)
        return self.classes[node, method_lift]

    def transform(self, lift: Lift, target):
        if lift.kind == "region":      # strip_lifts(region=True): raw jax.jit, no lift
            return lambda child, *args: jax.jit(lambda *a: target(child, *a))(*args)
        kw = lift.kwargs()
        if "policy" in kw:
            kw["policy"] = getattr(jax.checkpoint_policies, POLICIES[kw["policy"]])
        return getattr(self.nn, lift.kind)(target, **kw)

    def lifted(self, sub: Sub) -> type:
        """The class a ``Sub`` instantiates (``'fn'`` lifts wrap the call instead)."""
        if sub.lift is None or sub.lift.form == "fn":
            return self.cls(sub.node)
        if sub.lift.form == "method":
            return self.cls(sub.node, sub.lift)
        return self.transform(sub.lift, self.cls(sub.node))

    # The ops that are modules, constructed in setup or in the compact call.
    def construct(self, mdl, op, i: int, compact: bool):
        nn = self.nn
        if isinstance(op, Dense):
            return nn.Dense(op.features, use_bias=op.use_bias)
        if isinstance(op, Conv):
            return nn.Conv(op.features, kernel_size=(op.kernel,), padding="SAME", use_bias=op.use_bias)
        if isinstance(op, BatchNorm):
            kw = {} if op.as_arg else {"use_running_average": self._ura(mdl, op)}
            return nn.BatchNorm(momentum=op.momentum, axis_name=op.axis_name, **kw)
        if isinstance(op, LayerNorm):
            return nn.LayerNorm(use_bias=op.use_bias, use_scale=op.use_scale)
        if isinstance(op, Dropout):
            return nn.Dropout(op.rate, **({} if op.as_arg else {"deterministic": not mdl.train}))
        if isinstance(op, Sub):
            name = {"name": op.name} if compact and op.name else {}
            return self.lifted(op)(train=mdl.train, **name)
        return None

    def _make(self, node: Node, method_lift: Lift | None) -> type:
        nn, builder = self.nn, self

        def run(mdl, h, modules):
            """The ops on ``h``; ``modules[i]`` is op i's (setup-built) module, variable or
            branch children; ``None`` in compact style, where they are built here."""
            compact = modules is None
            mods = {} if compact else dict(enumerate(modules))
            for i, op in enumerate(node.ops):
                h = builder.apply_op(mdl, op, i, h, None if compact else modules[i], compact, mods)
            return h

        def modules(mdl):
            it = iter(mdl.layers if node.setup_list else ())
            return [(next(it) if node.setup_list else getattr(mdl, f"op{i}"))
                    if isinstance(op, _MODULE_OPS) else getattr(mdl, f"v{i}", None)
                    for i, op in enumerate(node.ops)]

        def setup(self):
            listed = []
            for i, op in enumerate(node.ops):
                for attr, value in builder.setup_items(self, op, i):
                    if node.setup_list and attr == f"op{i}":
                        listed.append(value)      # auto-named layers_0, layers_1, ...
                    else:
                        setattr(self, attr, value)
            if node.setup_list:
                self.layers = listed

        compact = node.style == "compact"
        if node.scan_body:
            def __call__(self, c, x):
                h = run(self, c + x, None if compact else modules(self))
                return h, h
        else:
            def __call__(self, h):
                return run(self, h, None if compact else modules(self))
        call = nn.compact(__call__) if compact else __call__
        if method_lift is not None:
            call = self.transform(method_lift, call)
        namespace = {"__annotations__": {"train": bool}, "train": False, "__module__": __name__,
                     "__qualname__": node.cls_name, "__call__": call}
        if not compact:
            namespace["setup"] = setup
        return type(node.cls_name, (nn.Module,), namespace)

    def setup_items(self, mdl, op, i: int) -> list:
        """``(attribute, value)`` pairs ``setup`` assigns for op ``i``: its module ``op{i}``,
        its param or ``Variable`` ``v{i}``, or a cond's / while's children ``cond{i}_a``,
        ``cond{i}_b``, ``while{i}`` (the branches reach them through the module they are
        given, as the lifted call requires)."""
        if isinstance(op, _MODULE_OPS):
            return [(f"op{i}", self.construct(mdl, op, i, compact=False))]
        if isinstance(op, Param):
            return [(f"v{i}", mdl.param(op.name, self.nn.initializers.normal(1.0), (op.width,)))]
        if isinstance(op, Counter) and op.kind != "put":
            return [(f"v{i}", self._counter(mdl, op))]
        if isinstance(op, Cond):
            out = [(f"cond{i}_a", self.cls(op.a)(train=mdl.train))]
            if isinstance(op.b, Node):
                out.append((f"cond{i}_b", self.cls(op.b)(train=mdl.train)))
            return out
        if isinstance(op, While):
            return [(f"while{i}", self.cls(op.node)(train=mdl.train))]
        return []

    @staticmethod
    def _ura(mdl, op: BatchNorm) -> bool:
        if op.use_running_average == "auto":
            return not mdl.is_mutable_collection("batch_stats")
        return op.use_running_average

    def _counter(self, mdl, op: Counter):
        if op.kind == "int":
            return mdl.variable(op.col, op.name, jnp.zeros, (), jnp.int32)
        return mdl.variable(op.col, op.name, lambda: jnp.zeros((), jnp.float32))

    def call_module(self, mdl, op, m, h):
        """Calls op ``op``'s module ``m`` on ``h``."""
        if isinstance(op, Sub) and op.lift is not None and op.lift.form == "fn":
            if op.node.scan_body:
                def body(child, c, x):
                    return child(c, x)
            else:
                def body(child, h):
                    return child(h)
            lifted = self.transform(op.lift, body)
            m = functools.partial(lifted, m)
        if isinstance(op, Sub) and op.node.scan_body:
            lift = op.lift.kwargs()
            axis = lift["in_axes"]
            c0 = jnp.zeros(h.shape[:axis] + h.shape[axis + 1:], h.dtype)
            c, ys = m(c0, h)
            return ys + jnp.expand_dims(c, lift["out_axes"]) * 0.5
        if isinstance(op, BatchNorm) and op.as_arg:
            return m(h, use_running_average=self._ura(mdl, op))
        if isinstance(op, Dropout) and op.as_arg:
            return m(h, deterministic=not mdl.train)
        return m(h)

    def apply_op(self, mdl, op, i: int, h, made, compact: bool, mods: dict):
        nn = self.nn
        if isinstance(op, _MODULE_OPS):
            m = self.construct(mdl, op, i, compact=True) if compact else made
            mods[i] = m
            return self.call_module(mdl, op, m, h)
        if isinstance(op, Reuse):
            return self.call_module(mdl, op.op, mods[op.index], h)
        if isinstance(op, Act):
            return nn.relu(h) if op.fn == "relu" else nn.tanh(h)
        if isinstance(op, Param):
            w = mdl.param(op.name, nn.initializers.normal(1.0), (op.width,)) if compact else made
            return h * jnp.broadcast_to(w, h.shape)
        if isinstance(op, Sow):
            if op.add:
                stored = mdl.sow("intermediates", f"sum_{op.name}", jnp.mean(h),
                                 init_fn=lambda: jnp.zeros((), jnp.float32), reduce_fn=lambda a, b: a + b)
            else:
                stored = mdl.sow("intermediates", f"seq_{op.name}", h)
            return h + (0.01 if stored else -0.01)
        if isinstance(op, Counter) and op.kind == "put":
            n = (mdl.get_variable(op.col, op.name) if mdl.has_variable(op.col, op.name)
                 else jnp.zeros((), jnp.int32)) + 1
            mdl.put_variable(op.col, op.name, n)
            return h * (1.0 + 0.1 * n.astype(jnp.float32))
        if isinstance(op, Counter):
            v = self._counter(mdl, op) if compact else made
            if op.kind == "int":
                v.value += 1
                return h * (1.0 + 0.1 * v.value.astype(jnp.float32))
            v.value = 0.5 * v.value + 0.5 * jnp.mean(h)
            return h + v.value
        if isinstance(op, Cond):
            return self._cond(mdl, op, i, h, made, compact)
        if isinstance(op, While):
            return self._while(mdl, op, i, h, made, compact)
        raise TypeError(op)

    def _cond(self, mdl, op: Cond, i: int, h, made, compact: bool):
        builder = self

        def child(m, which):
            if not compact:
                return getattr(m, f"cond{i}_{which}")
            node = op.a if which == "a" else op.b
            return builder.cls(node)(train=m.train, name=f"cond{i}_{which}")

        def true_fn(m, h):
            return child(m, "a")(h)

        def false_fn(m, h):
            if op.b == "shared":
                return child(m, "a")(h)
            if op.b == "neg":
                return -child(m, "a")(h)
            return child(m, "b")(h)
        if op.pre_init and mdl.is_initializing():
            child(mdl, "a")(h)
            if isinstance(op.b, Node):
                child(mdl, "b")(h)
        return self.nn.cond(jnp.sum(h) > 0, true_fn, false_fn, mdl, h)

    def _while(self, mdl, op: While, i: int, h, made, compact: bool):
        builder = self

        def cond_fn(m, c):
            return c[0] < op.n

        def body_fn(m, c):
            child = (builder.cls(op.node)(train=m.train, name=f"while{i}") if compact
                     else getattr(m, f"while{i}"))
            return c[0] + 1, child(c[1])
        if mdl.is_initializing():
            return body_fn(mdl, (jnp.zeros((), jnp.int32), h))[1]
        kw = {"carry_variables": list(op.carry) if op.carry else False}
        if op.broadcast:
            kw["broadcast_variables"] = list(op.broadcast)
        if op.split_dropout is not None:
            kw["split_rngs"] = {"dropout": op.split_dropout}
        return self.nn.while_loop(cond_fn, body_fn, mdl, (jnp.zeros((), jnp.int32), h), **kw)[1]


_MODULE_OPS = (Dense, Conv, BatchNorm, LayerNorm, Dropout, Sub)


def data(shape: tuple, seed: int):
    import numpy as np
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)

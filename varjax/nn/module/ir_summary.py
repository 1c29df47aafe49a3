"""The IR summary: the variables of a traced call, per module and collection.

Linen's ``Module.tabulate`` intercepts module calls at run time.  varjax already has every
variable in the IR, so the summary is two abstract traces and no computation:

* ``jax.eval_shape`` of ``init`` gives every variable's shape and dtype (no initializer runs,
  so a large model costs nothing to summarize);
* the effectful jaxpr of the call, traced with those abstract variables, says which variables
  the call reads and writes (its ``var_get`` / ``var_set`` equations, nested bodies included).
  A variable the call never touches is marked ``unused``.

A variable at path ``('Dense_0', 'kernel')`` belongs to module ``Dense_0``; the root module
(or a plain function using ``vj.param``) is ``""``.  Sizes are in 1024-based units.

It lives with the modules, below ``varjax.tools``, because ``Module.tabulate`` (Linen's
table, ``tabulation.py``) is built on it; ``varjax.tools.model_summary`` is its entry point for
any function, module or method, and the command line's.

Sharp edges:
  * Like ``init``, the trace keeps the ``intermediates`` collection out (Linen's default).
  * Non-array arguments are static, as everywhere in varjax; arrays and
    ``jax.ShapeDtypeStruct`` leaves are abstract.
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any, Iterable, Mapping

import jax
import numpy as np

from varjax import _jax
from varjax.functionalization.functionalized import Functionalized
from varjax.ir.nested import walk_eqns
from varjax.ir.primitives import Key, var_get_p, var_set_p
from varjax.nn.module.entry import DEFAULT_INIT_MUTABLE
from varjax.passes.framework.analysis import key_of
from varjax.trace.variable_dicts import variable_values


@dataclasses.dataclass(frozen=True)
class Row:
    """One array of one variable (a variable holding a pytree has one row per leaf)."""

    collection: str
    path: tuple[str, ...]  # the variable's path
    leaf: str              # "" for an array; the leaf's place, like "[0]", in a pytree value
    shape: tuple[int, ...]
    dtype: np.dtype
    count: int             # number of elements
    bytes: int
    access: str            # "read", "write", "read/write" or "unused" by the summarized call

    @property
    def module(self) -> str:
        """The module holding the variable: its path minus the name, joined with "/"."""
        return "/".join(self.path[:-1])

    @property
    def name(self) -> str:
        return self.path[-1] + self.leaf


@dataclasses.dataclass(frozen=True)
class Totals:
    """Arrays, elements and bytes of a group of rows."""

    arrays: int
    count: int
    bytes: int

    @staticmethod
    def of(rows: Iterable[Row]) -> "Totals":
        rows = list(rows)
        return Totals(len(rows), sum(r.count for r in rows), sum(r.bytes for r in rows))

    def __str__(self) -> str:
        if not self.arrays:
            return ""
        noun = "array" if self.arrays == 1 else "arrays"
        return f"{self.arrays} {noun}, {self.count:,} ({format_bytes(self.bytes)})"


@dataclasses.dataclass(frozen=True)
class Summary:
    """The variables of ``name``; ``str()`` is the per-module table."""

    name: str
    rows: tuple[Row, ...]

    @property
    def collections(self) -> list[str]:
        """``params`` first, then the others by name."""
        return sorted({r.collection for r in self.rows}, key=lambda c: (c != "params", c))

    @property
    def modules(self) -> list[str]:
        """Every module holding variables, with its ancestors; parents before children,
        siblings in the order the call first touches them."""
        found: dict[str, None] = {}
        for r in self.rows:
            found.update(dict.fromkeys(_ancestry(r.path)))
        return list(found)

    def totals(self, module: str | None = None) -> dict[str, Totals]:
        """Per collection, the totals of one module's own variables, or of all (``None``)."""
        groups: dict[str, list[Row]] = defaultdict(list)
        for r in self.rows:
            if module is None or r.module == module:
                groups[r.collection].append(r)
        return {c: Totals.of(rows) for c, rows in groups.items()}

    def table(self, detail: bool = False) -> str:
        """One line per module with a column per collection, then the totals; with
        ``detail``, one line per variable instead."""
        if detail:
            header = ["module", "collection", "name", "shape", "dtype", "count", "bytes", "access"]
            body = [[self._label(r.module), r.collection, r.name, _shape(r.shape), str(r.dtype),
                     f"{r.count:,}", format_bytes(r.bytes), r.access] for r in self.rows]
            total = ["total", "", "", "", "", f"{sum(r.count for r in self.rows):,}",
                     format_bytes(sum(r.bytes for r in self.rows)), ""]
        else:
            cols = self.collections
            header = ["module", *cols]
            body = []
            for m in self.modules:
                own = self.totals(m)
                body.append([self._label(m), *(str(own.get(c, "")) for c in cols)])
            everything = self.totals()
            total = ["total", *(str(everything[c]) for c in cols)]
        return _render(header, body, total, right={5, 6} if detail else set())

    def __str__(self) -> str:
        return self.table()

    def _label(self, module: str) -> str:
        return module or f"{self.name} (root)"


def format_bytes(n: int) -> str:
    """``4224`` -> ``"4.1 KB"`` (1024-based, one decimal above bytes)."""
    size, unit = float(n), "B"
    for bigger in ("KB", "MB", "GB", "TB"):
        if size < 1024:
            break
        size, unit = size / 1024, bigger
    return f"{n} B" if unit == "B" else f"{size:,.1f} {unit}"


def summarize(fz: Functionalized, name: str, *args: Any, rngs: Any = None,
              mutable: Any = DEFAULT_INIT_MUTABLE, **kwargs: Any) -> Summary:
    """Summarize the variables ``fz`` (named ``name`` in the table) creates and touches when
    called with ``args``/``kwargs``; ``rngs`` go to ``init`` (default ``jax.random.key(0)``)
    and to the traced call, ``mutable`` to both (default: all but ``intermediates``)."""
    rngs = jax.random.key(0) if rngs is None else rngs
    # Only arrays go through eval_shape; Python values stay static, as in apply.
    leaves, tree = jax.tree.flatten((args, kwargs))
    is_array = [isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)) for x in leaves]
    traced: list[_jax.ClosedJaxpr] = []

    def init_and_trace(*arrays: Any) -> dict[str, Any]:
        it = iter(arrays)
        a, kw = jax.tree.unflatten(tree, [next(it) if arr else x for x, arr in zip(leaves, is_array)])
        variables = fz.init(rngs, *a, mutable=mutable, **kw)
        traced.append(fz.jaxpr(*a, variables=variables, rngs=rngs, mutable=mutable, **kw))
        return variables

    shapes = jax.eval_shape(init_and_trace, *(x for x, arr in zip(leaves, is_array) if arr))
    access, order = _access(traced[0])
    rows = []
    for (collection, path), value in variable_values(shapes).items():
        for leaf_path, leaf in jax.tree_util.tree_flatten_with_path(value)[0]:
            count = int(np.prod(leaf.shape, dtype=np.int64))
            rows.append(Row(collection, path, jax.tree_util.keystr(leaf_path), tuple(leaf.shape),
                            leaf.dtype, count, count * leaf.dtype.itemsize,
                            access.get((collection, path), "unused")))
    return Summary(name, tuple(_in_call_order(rows, order)))


def _access(jaxpr: _jax.ClosedJaxpr) -> tuple[dict[Key, str], dict[Key, int]]:
    """Per variable the jaxpr touches: ``read`` / ``write`` / ``read/write``, and the position
    of its first access (nested bodies included)."""
    reads, writes, order = set(), set(), {}
    for eqn, _ in walk_eqns(jaxpr):
        if eqn.primitive in (var_get_p, var_set_p):
            key = key_of(eqn)
            (reads if eqn.primitive is var_get_p else writes).add(key)
            order.setdefault(key, len(order))
    access = {k: "/".join(w for w, hit in (("read", k in reads), ("write", k in writes)) if hit)
              for k in order}
    return access, order


def _in_call_order(rows: list[Row], order: Mapping[Key, int]) -> list[Row]:
    """Sorted as Linen's table follows the calls: a module's own variables, then its
    submodules, each in the order the call first touches it (or anything under it); modules
    the call never touches last, by name.  Within a module, ``params`` comes first."""
    unused = len(order)
    first: dict[str, int] = {}
    for r in rows:
        for m in _ancestry(r.path):
            first[m] = min(first.get(m, unused), order.get((r.collection, r.path), unused))
    return sorted(rows, key=lambda r: (
        [(first[m], m) for m in _ancestry(r.path)], r.collection != "params", r.collection,
        order.get((r.collection, r.path), unused), r.name))


def _ancestry(path: tuple[str, ...]) -> list[str]:
    """The modules holding variable ``path``, outermost (the root, ``""``) first."""
    return ["/".join(path[:i]) for i in range(len(path))]


def _shape(shape: tuple[int, ...]) -> str:
    return "[" + ",".join(map(str, shape)) + "]"


def _render(header: list[str], body: list[list[str]], total: list[str], right: set[int]) -> str:
    """A plain-text table: header, rule, body, rule, totals; columns ``right`` (numbers)
    right-aligned."""
    lines = [header, *body, total]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]

    def fmt(line: list[str]) -> str:
        return " | ".join(cell.rjust(w) if i in right else cell.ljust(w)
                          for i, (cell, w) in enumerate(zip(line, widths))).rstrip()

    rule = "-+-".join("-" * w for w in widths)
    return "\n".join([fmt(header), rule, *map(fmt, body), rule, fmt(total)])

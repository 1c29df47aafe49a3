"""``Module.tabulate``, ``nn.tabulate`` and ``Module.module_paths``: Linen's module table.

Linen's table has one row per module method call: its path, class, inputs and outputs
(shapes and dtypes), and a column per variable collection with the module's own variables
and their count and size.  varjax builds it from two things it already has:

* the module calls, recorded by an interceptor (``intercept_methods``) while ``init`` is
  traced abstractly (``jax.eval_shape``: no initializer and no layer runs);
* the variables, from the IR summary of the same call (``summary.summarize``).

The table is drawn in plain text with Linen's layout (``rich``'s box characters, a title, a
footer row of totals and a "Total Parameters" caption), without colour codes and without
cutting cells to a console width.

Sharp edges:
  * ``compute_flops`` / ``compute_vjp_flops`` and rich's ``console_kwargs`` /
    ``table_kwargs`` / ``column_kwargs`` are not provided: they raise ``ModuleError``.
  * Collections are ordered ``params`` first, then by name (Linen's order is a set's).
  * A module made by a lifted transform (``nn.vmap(nn.Dense)``) has the row of its lifted
    call, ``VmapDense`` with the batched shapes; Linen shows the call inside the transform
    (``Dense``, one example's shapes).
  * Sizes use Linen's decimal units (``1.0 KB`` is 1,001 bytes and up), unlike the IR
    summary's 1024-based ones.
"""
from __future__ import annotations

import dataclasses
import types
from typing import Any, Callable, Mapping

import jax
import numpy as np

from varjax.ir import errors
from varjax.ir.typing import CollectionFilter, RngsLike
from varjax.nn.module.entry import DEFAULT_INIT_MUTABLE, EntryPoints, resolve_method
from varjax.nn.module.interception import InterceptorContext, intercept_methods
from varjax.nn.module.ir_summary import Row, summarize
from varjax.trace.context import site


@dataclasses.dataclass(frozen=True)
class Call:
    """One module method call seen while ``init`` was traced."""

    path: tuple[str, ...]
    module: Any                # an unbound copy of the module, as Linen's ``module_copy``
    method: str
    inputs: Any                # arrays as jax.ShapeDtypeStruct
    outputs: Any


def record_calls(module: EntryPoints, rngs: RngsLike, *args: Any,
                 method: str | Callable[..., Any] | None = None,
                 mutable: CollectionFilter = DEFAULT_INIT_MUTABLE, **kwargs: Any) -> tuple[list[Call], Any]:
    """The calls ``module.init(rngs, *args, **kwargs)`` makes, in order, and its IR summary."""
    calls: list[Call | None] = []      # in the order the calls start, as Linen numbers them

    def record(next_fun: Callable[..., Any], a: tuple, kw: dict, context: InterceptorContext) -> Any:
        m = context.module
        if context.method_name == "setup" or m.scope is None or not m.is_initializing():
            return next_fun(*a, **kw)
        index = len(calls)
        calls.append(None)
        out = next_fun(*a, **kw)
        inputs = a[0] if len(a) == 1 and not kw else ((*a, kw) if a and kw else (a or kw))
        calls[index] = Call(m.path, m.copy(parent=None), context.method_name,
                            _abstract(inputs), _abstract(out))
        return out
    with intercept_methods(record):
        # A fresh Functionalized, kept in no cache: it traces (so the interceptor runs), and
        # repeated tables leave nothing behind on the module.
        fz = module._new_functionalized(resolve_method(module, method), False)
        found = summarize(fz, type(module).__name__, *args, rngs=rngs, mutable=mutable, **kwargs)
    return [c for c in calls if c is not None], found


def _abstract(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
                        if isinstance(x, (jax.Array, np.ndarray)) else x, tree)


# Linen's defaults of the rich options, which varjax does not take.
_NONE: Mapping[str, Any] = types.MappingProxyType({})


class Tabulation(EntryPoints):
    """Linen's module inspection methods."""

    def module_paths(self, rngs: RngsLike, *args: Any, show_repeated: bool = False,
                     mutable: CollectionFilter = DEFAULT_INIT_MUTABLE, **kwargs: Any) -> dict[str, Any]:
        """``{path: unbound copy of the module}`` for every module ``init`` calls
        (``"sub/Dense_0"``; the root is ``""``), computed abstractly.  ``show_repeated`` is
        Linen's: repeated calls of a module have its path, so the dict is the same."""
        calls, _ = record_calls(self, rngs, *args, mutable=mutable, **kwargs)
        return {"/".join(c.path): c.module for c in calls}

    def tabulate(self, rngs: RngsLike, *args: Any, depth: int | None = None,
                 show_repeated: bool = False, mutable: CollectionFilter = DEFAULT_INIT_MUTABLE,
                 console_kwargs: Mapping[str, Any] | None = None,
                 table_kwargs: Mapping[str, Any] = _NONE, column_kwargs: Mapping[str, Any] = _NONE,
                 compute_flops: bool = False, compute_vjp_flops: bool = False,
                 **kwargs: Any) -> str:
        """Linen's table of the calls ``init`` makes: one row per module call (to ``depth``
        levels below the root), its inputs, outputs and variables per collection."""
        return tabulate(self, rngs, depth=depth, show_repeated=show_repeated, mutable=mutable,
                        console_kwargs=console_kwargs, table_kwargs=table_kwargs,
                        column_kwargs=column_kwargs, compute_flops=compute_flops,
                        compute_vjp_flops=compute_vjp_flops, **kwargs)(*args)


def tabulate(module: Tabulation, rngs: RngsLike, depth: int | None = None,
             show_repeated: bool = False, mutable: CollectionFilter = DEFAULT_INIT_MUTABLE,
             console_kwargs: Mapping[str, Any] | None = None,
             table_kwargs: Mapping[str, Any] = _NONE, column_kwargs: Mapping[str, Any] = _NONE,
             compute_flops: bool = False, compute_vjp_flops: bool = False,
             **kwargs: Any) -> Callable[..., str]:
    """Linen's ``nn.tabulate``: ``(*args, **kwargs) -> str``, the table of ``module`` called
    with those arguments (see ``Module.tabulate``)."""
    unsupported = [n for n, v in (("compute_flops", compute_flops),
                                  ("compute_vjp_flops", compute_vjp_flops),
                                  ("console_kwargs", console_kwargs),
                                  ("table_kwargs", table_kwargs),
                                  ("column_kwargs", column_kwargs)) if v]
    if unsupported:
        raise errors.ModuleError(
            f"tabulate: {', '.join(unsupported)} not provided: varjax draws the table in plain "
            "text without rich, and counts no FLOPs.", **site(about=module),
            fix="leave them out; for FLOPs use jax.jit(...).lower(...).cost_analysis()")

    def table(*args: Any, **call_kwargs: Any) -> str:
        calls, found = record_calls(module, rngs, *args, mutable=mutable, **kwargs, **call_kwargs)
        return render(type(module).__name__, _rows(calls, found.rows, depth, show_repeated),
                      found.collections)
    return table


@dataclasses.dataclass(frozen=True)
class TableRow:
    call: Call
    own: list[Row]             # variables shown in the row
    counted: list[Row]         # variables counted in the row (with the submodules cut by depth)


def _rows(calls: list[Call], rows: tuple[Row, ...], depth: int | None,
          show_repeated: bool) -> list[TableRow]:
    paths = {c.path for c in calls}

    def owner(row: Row) -> tuple[str, ...]:
        """The deepest called module holding the variable."""
        path = row.path[:-1]
        while path and path not in paths:
            path = path[:-1]
        return path
    seen: set[tuple[str, ...]] = set()
    out = []
    for c in calls:
        if c.path in seen:
            if show_repeated:
                out.append(TableRow(c, [], []))
            continue
        if depth is not None and len(c.path) > depth:
            continue
        seen.add(c.path)
        own = [r for r in rows if owner(r) == c.path]
        below = [r for r in rows if r.path[:len(c.path)] == c.path]
        out.append(TableRow(c, own, below if depth is not None and len(c.path) == depth else own))
    return out


def render(name: str, rows: list[TableRow], collections: list[str]) -> str:
    """The table in Linen's layout, as plain text."""
    header = ["path", "module", "inputs", "outputs", *collections]
    body, totals = [], {c: [0, 0] for c in collections}
    for r in rows:
        cells = ["/".join(r.call.path), type(r.call.module).__name__ + (
            "" if r.call.method in ("__call__", "<lambda>") else f" ({r.call.method})"),
            _yaml_text(r.call.inputs), _yaml_text(r.call.outputs)]
        for col in collections:
            own = {x.name: _array_text(x.shape, x.dtype) for x in r.own if x.collection == col}
            counted = [x for x in r.counted if x.collection == col]
            size, nbytes = sum(x.count for x in counted), sum(x.bytes for x in counted)
            totals[col][0] += size
            totals[col][1] += nbytes
            text = "\n".join(f"{k}: {v}" for k, v in sorted(own.items()))
            cells.append((text + "\n\n" if text else "") + _size_text(size, nbytes))
        body.append(cells)
    footer = ["", "", "", "Total", *(_size_text(*totals[c]) for c in collections)]
    everything = (sum(t[0] for t in totals.values()), sum(t[1] for t in totals.values()))
    return _draw(f"{name} Summary", header, body, footer,
                 f"Total Parameters: {_size_text(*everything)}")


def _draw(title: str, header: list[str], body: list[list[str]], footer: list[str],
          caption: str) -> str:
    grid = [header, *body, footer]
    widths = [max(len(line) for row in grid for line in row[i].split("\n")) for i in range(len(header))]

    def rule(left: str, fill: str, mid: str, right: str) -> str:
        return left + mid.join(fill * (w + 2) for w in widths) + right

    def lines(row: list[str], bar: str, justify: list[str]) -> list[str]:
        split = [cell.split("\n") for cell in row]
        return [bar + bar.join(f" {(s[k] if k < len(s) else ''):{j}{w}} "
                               for s, w, j in zip(split, widths, justify)) + bar
                for k in range(max(len(s) for s in split))]
    left = ["<"] * len(header)
    right_total = ["<", "<", "<", ">"] + ["<"] * (len(header) - 4)
    out = lines(header, "┃", left)
    out = [rule("┏", "━", "┳", "┓"), *out, rule("┡", "━", "╇", "┩")]
    for i, row in enumerate(body):
        if i:
            out.append(rule("├", "─", "┼", "┤"))
        out.extend(lines(row, "│", left))
    out.append(rule("├", "─", "┼", "┤"))
    out.extend(lines(footer, "│", right_total))
    out.append(rule("└", "─", "┴", "┘"))
    width = len(out[0])
    return "\n".join(["", title.center(width).rstrip(), *out, "", caption.center(width).rstrip(),
                      ""]) + "\n"


def _size_text(size: int, nbytes: int) -> str:
    """Linen's ``1,234 (4.9 KB)`` (decimal units); empty for nothing."""
    if not size:
        return ""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if nbytes > scale:
            return f"{size:,} ({nbytes / scale:,.1f} {unit})"
    return f"{size:,} ({nbytes:,} B)"


def _array_text(shape: tuple[int, ...], dtype: Any) -> str:
    return f"{np.dtype(dtype).name}[{','.join(map(str, shape))}]"


def _yaml_text(value: Any) -> str:
    """A value as Linen's table shows it: YAML-like, arrays as ``float32[2,3]``."""
    if value is None or (isinstance(value, (tuple, list, dict)) and not value):
        return ""
    return "\n".join(_yaml(value))


def _yaml(value: Any) -> list[str]:
    if isinstance(value, dict) and value:
        out = []
        for k in sorted(value, key=str):
            inner = _yaml(value[k])
            if _nested(value[k]):
                out.append(f"{k}:")
                pad = "  " if isinstance(value[k], dict) else ""
                out.extend(pad + line for line in inner)
            else:
                out.append(f"{k}: {inner[0]}")
        return out
    if isinstance(value, (tuple, list)) and value:
        out = []
        for item in value:
            inner = _yaml(item)
            out.append("- " + inner[0])
            out.extend("  " + line for line in inner[1:])
        return out
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return [_array_text(tuple(value.shape), value.dtype)]
    if isinstance(value, (tuple, list, dict)):
        return ["[]" if not isinstance(value, dict) else "{}"]
    return [repr(value).replace("'", "")]


def _nested(value: Any) -> bool:
    return isinstance(value, (tuple, list, dict)) and bool(value)


"""Pass options: declared constraints, checked whenever a pass is made.

A pass's options are its dataclass fields.  A field annotated ``Annotated[int, AtLeast(1)]``
declares what values make sense; ``Pass.__post_init__`` checks every field against its
annotation -- the value's type, then each constraint -- and then the pass's ``check()``
for relations between options.  A bad value is a ``PipelineError`` naming the pass, the
option and why, raised where the pass is made: when a pipeline string is parsed, or when
``Lora(rank=0)`` is written in Python.  Without this a bad option surfaces mid-trace as a
"bug in the pass" (``re.error`` from a bad regular expression, a dtype lax refuses), or not
at all (``rank=0`` adapters).

The pipeline parser converts option text by the base type (``Annotated`` is transparent to
it); the constraints here run on the converted value.
"""
from __future__ import annotations

import dataclasses
import functools
import re
import types
import typing
from typing import Any, Sequence, Union

import jax.numpy as jnp

from varjax.ir import errors, nested
from varjax.ir.primitives import Key, is_internal, var_get_p, var_set_p


class Constraint:
    """One condition on an option's value; ``why_not`` says what is wrong, or None."""

    def why_not(self, value: Any) -> str | None:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class AtLeast(Constraint):
    low: int

    def why_not(self, value: Any) -> str | None:
        return None if value >= self.low else f"must be {self.low} or more"


@dataclasses.dataclass(frozen=True)
class Between(Constraint):
    low: int
    high: int

    def why_not(self, value: Any) -> str | None:
        return None if self.low <= value <= self.high else \
            f"must be between {self.low} and {self.high}"


class Regex(Constraint):
    """A regular expression ``re`` compiles."""

    def why_not(self, value: Any) -> str | None:
        try:
            re.compile(value)
        except re.error as e:
            return f"is not a regular expression ({e})"
        return None


class FloatDtype(Constraint):
    """The name of a floating dtype (``bfloat16``, ``float16``)."""

    def why_not(self, value: Any) -> str | None:
        try:
            dtype = jnp.dtype(value)
        except TypeError:
            return "is not a dtype name (e.g. bfloat16, float16, float32)"
        if not jnp.issubdtype(dtype, jnp.floating):
            return f"must be a floating dtype (bfloat16, float16, float32), not {dtype.name}"
        return None


class Name(Constraint):
    """A collection name a user may use: not empty, no ``/``, not varjax's ``__*``."""

    def why_not(self, value: Any) -> str | None:
        if not value or "/" in value:
            return "must be a collection name such as params"
        if value.startswith("__"):
            return "names one of varjax's own collections ('__*')"
        return None


class VariablePath(Constraint):
    """A ``/``-separated path with at least one name and no empty one."""

    def __init__(self, empty: bool = False):
        self.empty = empty

    def why_not(self, value: Any) -> str | None:
        inner = value.strip("/")
        if not inner:
            return None if self.empty else "must name a variable, e.g. Dense_0/kernel"
        return None if all(inner.split("/")) else "has an empty name between '/'s"


def option_fields(p: Any) -> tuple[dataclasses.Field, ...]:
    """The options of pass (class) ``p``: its dataclass fields a pipeline string can set;
    not ``roots``, which ``Pass.rooted`` sets."""
    return tuple(f for f in dataclasses.fields(p) if f.init)


def check_options(p: Any) -> None:
    """``PipelineError`` unless every option of pass ``p`` has its declared type and meets
    its constraints, and ``p.check()`` accepts their combination."""
    for name, (kind, constraints) in _declared(type(p)).items():
        value = getattr(p, name)
        why = None if _has_type(value, kind) else f"must be {_describe(kind)}"
        if why is None:
            why = next((w for c in constraints if (w := c.why_not(value)) is not None), None)
        if why is not None:
            raise _error(p, f"{name} {why}, got {value!r}", name)
    try:
        p.check()
    except ValueError as e:
        raise _error(p, str(e), None) from None


def _error(p: Any, why: str, option: str | None) -> errors.PipelineError:
    valid = ", ".join(f.name for f in option_fields(p)) or "none"
    fix = f"give option '{option}' a value it accepts" if option else "give options that fit together"
    return errors.PipelineError(f"pass '{p.name}': {why}", source=errors.source_text(),
                                fix=f"{fix}; valid options: {valid}")


@functools.cache
def _declared(cls: type) -> dict[str, tuple[Any, tuple[Constraint, ...]]]:
    """``{option: (base type, constraints)}`` of a pass class, from its annotations; an
    annotation that cannot be resolved here declares nothing."""
    try:
        hints = typing.get_type_hints(cls, include_extras=True)
    except (NameError, TypeError):
        return {}
    out = {}
    for f in option_fields(cls):
        kind = hints.get(f.name, Any)
        constraints: tuple[Constraint, ...] = ()
        if typing.get_origin(kind) is typing.Annotated:
            kind, *extra = typing.get_args(kind)
            constraints = tuple(c for c in extra if isinstance(c, Constraint))
        out[f.name] = (kind, constraints)
    return out


def _has_type(value: Any, kind: Any) -> bool:
    """Whether ``value`` is of the plain option type ``kind``; types it does not know
    (``np.dtype``, literals, a pass's own classes) are the pass's to check."""
    if typing.get_origin(kind) in (Union, types.UnionType):
        return any(_has_type(value, k) for k in typing.get_args(kind))
    if kind is type(None):
        return value is None
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is str:
        return isinstance(value, str)
    return True


def _describe(kind: Any) -> str:
    if typing.get_origin(kind) in (Union, types.UnionType):
        return " or ".join(_describe(k) for k in typing.get_args(kind))
    return "None" if kind is type(None) else f"a {getattr(kind, '__name__', kind)}"


# --- options that select variables --------------------------------------------------------
#
# A selecting option that selects nothing makes its pass do nothing, silently: a typo'd
# ``collection=parms`` freezes nothing.  A pass checks its selection against every variable
# the program has: given, read or written anywhere (a lifted transform's boundary
# accesses carry the full paths of the variables its bodies use), or asked for by the code
# (``PassContext.asked``).  A lifted body's own pipeline (``ctx.region``) sees only what
# was handed in, and a legit option may select only variables outside it: there the check
# is left to the enclosing program's pipeline, which sees the body's variables at the
# boundary.  A rooted pass (``Pass.rooted``) checks against the variables under its roots,
# by the paths its options use.


def given_variables(p: Any, ctx: Any) -> frozenset[Key]:
    """The variables given to the program that pass ``p`` sees (paths as its options name
    them: ``Pass.relative``)."""
    return _seen(p, ctx.variables)


def program_variables(p: Any, jaxpr: Any, ctx: Any) -> frozenset[Key]:
    """Every user variable of the program ``jaxpr`` run in ``ctx`` that pass ``p`` sees
    (see above), paths as its options name them."""
    found = {*ctx.variables, *ctx.asked}
    for eqn, _ in nested.walk_eqns(jaxpr):
        if eqn.primitive in (var_get_p, var_set_p):
            found.add((eqn.params["collection"], eqn.params["path"]))
    return _seen(p, found)


def _seen(p: Any, keys: Any) -> frozenset[Key]:
    seen = set()
    for collection, path in keys:
        named = p.relative(path)
        if named is not None and not is_internal(collection):
            seen.add((collection, named))
    return frozenset(seen)


def check_collection(p: Any, option: str, collection: str, jaxpr: Any, ctx: Any) -> None:
    """``PipelineError`` naming ``option`` unless the program has a variable of
    ``collection`` that ``p`` sees (not checked in a lifted body: see above)."""
    if ctx.region or any(c == collection for c, _ in given_variables(p, ctx)):
        return
    have = {c for c, _ in program_variables(p, jaxpr, ctx)}
    if collection not in have:
        raise unmatched(p, f"{option}={collection}", "matches no collection of the program",
                        "collections", sorted(have))


def unmatched(p: Any, option: str, why: str, what: str, existing: Sequence[str]) -> errors.PipelineError:
    """The error for option text ``option`` of pass ``p`` that selects nothing, listing the
    ``existing`` things (``what``) it could have named.  A rooted pass says whose variables
    it looked at (the arguments of an object-mode call bound with it)."""
    listed = ", ".join(existing[:20]) + (f", ... ({len(existing)} in all)" if len(existing) > 20 else "")
    whose = ""
    if p.roots:
        whose = " in the variables of argument " + ", ".join(
            errors.format_path(at) for at, _ in sorted(p.roots))
    return errors.PipelineError(
        f"pass '{p.spec()}': option {option} {why}{whose}, so the pass would do nothing; the "
        f"{what} are: {listed or 'none'}.", source=errors.source_text(),
        fix=f"spell {option.partition('=')[0]} as one of the {what} listed")

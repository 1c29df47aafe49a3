"""The pass contract.

A pass is a frozen dataclass: its fields are its options, ``name`` is its
kebab-case registry name, and ``run`` maps a ClosedJaxpr to a ClosedJaxpr.

What a pass may do: read its options and the ``PassContext``, return a new
jaxpr, record results in ``ctx.results`` and counters in ``ctx.stats``.
What it may not do: keep state between runs, mutate the jaxpr it was given
(jaxprs are shared, e.g. by caches), or return an invalid jaxpr: the pipeline
verifies after every pass.  A pass that changes nothing returns the very
object it was given, so "did it change?" is an identity check.

Ordering is declared, not positional: ``requires`` names passes that must run
earlier (they are added to a pipeline that lacks them), ``after``/``before``
order this pass relative to others only when both are present.  Subclasses
register themselves by ``name`` when defined; a subclass that does not set its
own ``name`` is not registered, and a name taken by another class raises.

Roots: a pass may run for part of a program only -- a module bound with ``passes=`` and
called in an object-mode transform, whose variables live at ``m/Dense_0/kernel``.  Its
options were written for the module alone (``under=Dense_0``), so the pass is *rooted*
(``Pass.rooted``): it touches only the variables under its roots, and sees their paths as
the module does (``Pass.relative``).  A pass says it honours roots with ``rootable``.
"""
from __future__ import annotations

import collections
import copy
import dataclasses
from typing import Any, Callable, ClassVar, ContextManager, Mapping, Sequence

import jax

from varjax import _jax
from varjax.ir import errors, filters, streams
from varjax.ir.primitives import Key, Path, VarType, rng_draw_p, var_get_p, var_set_p
from varjax.ir.typing import CollectionFilter
from varjax.passes.framework.options import check_options, option_fields

REGISTRY: dict[str, type["Pass"]] = {}

# A root: where part of the program's variables live (a path prefix of the program) and the
# path the pass's options name that place by.  A module passed as argument ``m`` is
# ``(("m",), ())``; its submodule ``Dense_0`` passed alone as ``d`` is ``(("d",),
# ("Dense_0",))``, as an eager call of it sees the paths of the module it was bound from.
Root = tuple[Path, Path]


def relative_path(roots: Sequence[Root], path: Path) -> Path | None:
    """Program path ``path`` as a pass rooted at ``roots`` names it; None outside every
    root.  No roots is the whole program, named as it is."""
    if not roots:
        return path
    for at, named in roots:          # longest first (``Pass.rooted``): the nearest root
        if path[:len(at)] == at:
            return named + path[len(at):]
    return None


def program_paths(roots: Sequence[Root], named: Path) -> tuple[Path, ...]:
    """The program paths a pass rooted at ``roots`` means by ``named`` (one per root that
    can hold it): the inverse of ``relative_path``."""
    if not roots:
        return (named,)
    return tuple(at + named[len(base):] for at, base in roots if named[:len(base)] == base)


@dataclasses.dataclass
class PassContext:
    """What a pipeline run knows beyond the jaxpr itself.

    ``variables`` maps ``(collection, path)`` to the ``VarType`` of every
    variable given as input; ``mutable`` is the collection filter of writable
    collections; ``rng_streams`` maps stream names to key avals.  ``results``
    carries pass outputs that are not
    IR (the discharge signature); ``stats`` per-pass counters.

    ``reenter`` re-enters the trace the program came from: ``with ctx.reenter(types):``
    runs user code as if at a program point where the variables have ``types``.  Passes
    need it for the user code JAX traces late (custom_jvp/vjp rules, traced when JAX first
    differentiates, possibly after the pipeline has returned).  None for a program that
    did not come from a varjax trace.
    """

    variables: dict = dataclasses.field(default_factory=dict)
    mutable: CollectionFilter = False
    rng_streams: dict = dataclasses.field(default_factory=dict)
    results: dict = dataclasses.field(default_factory=dict)
    stats: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    reenter: Callable[[Mapping[Key, VarType]], ContextManager[Any]] | None = None
    # Enters module code at a module path (``in_module``); set by functionalize.
    modules: Callable[[Path], ContextManager[Any]] | None = None
    # True when the program is the body of a lifted transform (``nn.scan``, ``nn.remat``):
    # its variables are the part of the whole program's that the transform handed in, so
    # a pass must not report a variable it is about as missing from the program.
    region: bool = False
    # The variables a pass supplies (``Pass.supplies``) that the model code asked for
    # anywhere in the program, lifted bodies included: one used only inside a body, whose
    # own pipeline replaced its reads, appears nowhere in the program but is used.
    asked: frozenset = frozenset()

    @classmethod
    def for_inputs(cls, variables: Mapping[Key, VarType], mutable: CollectionFilter = False,
                   rng_streams: Mapping[str, Any] | None = None,
                   reenter: Callable[[Mapping[Key, VarType]], ContextManager[Any]] | None = None,
                   ) -> "PassContext":
        """The context of a call given ``variables`` (their types), the ``mutable`` filter
        and RNG keys (``rng_streams``: stream name to key aval).  Each explicit key is
        also a read-only variable (``streams.explicit_key``), which is how ``lower-rng``
        reads it; the one place that says so, for ``functionalize`` and the tests alike."""
        rng_streams = dict(rng_streams or {})
        given = dict(variables)
        given.update({streams.explicit_key(s): VarType(_SCALAR, (aval,))
                      for s, aval in rng_streams.items()})
        return cls(variables=given, mutable=mutable, rng_streams=rng_streams, reenter=reenter)

    def known_collections(self) -> frozenset[str] | None:
        """The collections a program run in this context may touch: those of the given
        variables and those ``mutable`` names (new variables may be created there); None
        when ``mutable`` admits collections it does not name (``True``, a ``DenyList``),
        so any collection may be created.  Those of the variables passes supply (``asked``)
        are read without being given.  varjax's own ``__*`` collections are always
        allowed, listed or not.  The pipeline gives this to its verifier, so a misspelt
        collection fails at the pipeline input."""
        named = _named_collections(self.mutable)
        if named is None:
            return None
        return named | {collection for collection, _ in (*self.variables, *self.asked)}

    def in_module(self, where: _jax.JaxprEqn | Path) -> ContextManager[Any]:
        """``with ctx.in_module(eqn):`` runs model code -- ``vj.param``, ``vj.variable``,
        ``vj.make_rng`` -- as the module that traced ``eqn`` would: variables are created at
        its path, read when they exist, and draw keys as that module's next draws.

        This is how a pass creates variables (a LoRA adapter beside the kernel it adapts).
        ``where`` is a ``var_get``/``var_set`` equation (its variable's module), an
        ``rng_draw`` of a module, or a module path.  All calls in one pipeline run share one
        view, so a module rewritten twice (called twice) finds its adapters made the first
        time; in ``init`` they are created, in ``apply`` read from the given variables.  A
        pass using it emits ``var_set`` and ``rng_draw``: declare it
        ``before = ("lower-rng", ...)``, which lowers the draws."""
        if self.modules is None:
            raise errors.PassError(
                "in_module needs the trace the program came from, and this pipeline was run "
                "on a jaxpr that did not come from a varjax trace.", source=errors.source_text(),
                fix="run the pass through vj.functionalize / Module.init / apply (passes=...)")
        return self.modules(module_path(where))

    def count(self, pass_name: str, what: str, n: int = 1) -> None:
        self.stats[f"{pass_name}.{what}"] += n


_SCALAR = jax.tree.structure(0)


def module_path(where: _jax.JaxprEqn | Path) -> Path:
    """The module path an equation belongs to (see ``PassContext.in_module``)."""
    if isinstance(where, tuple) and all(isinstance(n, str) for n in where):
        return where
    primitive = getattr(where, "primitive", None)
    if primitive is var_get_p or primitive is var_set_p:
        return tuple(where.params["path"][:-1])
    if primitive is rng_draw_p and where.params["path"] is not None:
        return tuple(where.params["path"])
    raise errors.PassError(
        f"cannot tell which module {where!r} belongs to.", source=errors.source_text(),
        fix="pass a var_get/var_set equation, a module's rng_draw, or the module path "
            "as a tuple of names")


def _named_collections(f: filters.Filter | None) -> frozenset[str] | None:
    """The collections filter ``f`` matches, if it names them all; None if it matches
    collections it does not name."""
    if f is True or isinstance(f, filters.DenyList):
        return None
    if f is False or f is None:
        return frozenset()
    if isinstance(f, str):
        return frozenset((f,))
    parts = [_named_collections(x) for x in f]
    return None if any(p is None for p in parts) else frozenset().union(*parts)


@dataclasses.dataclass(frozen=True)
class Pass:
    """Base class of every pass; see the module docstring for the contract."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    requires: ClassVar[tuple[str, ...]] = ()
    after: ClassVar[tuple[str, ...]] = ()
    before: ClassVar[tuple[str, ...]] = ()
    # True for passes after which no varjax primitive or effect may remain.
    discharges: ClassVar[bool] = False
    # Effect classes this pass lowers (lower-rng: ``RngEffect``): a later pass that emits
    # one is misordered, and the pipeline says which pass it must run before.
    lowers: ClassVar[tuple[type, ...]] = ()
    # True for a pass that honours ``roots``: it touches only the variables under them and
    # reads their paths through ``relative`` (the selecting passes), or its work is the
    # same whatever part of the program it is for (lower-rng).  A pass that does not say
    # so cannot be rooted: it would apply to every argument of an object-mode call, with
    # paths its options were not written for.
    rootable: ClassVar[bool] = False
    # Compared and hashed, so rooted pipelines cache apart.
    roots: tuple[Root, ...] = dataclasses.field(default=(), init=False)
    """Where the pass applies: ``()`` is the whole program, else the module paths it is rooted
    at (set by ``Pass.rooted``, not an option)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "name" not in cls.__dict__:   # a subclass of a pass that keeps its name: no entry
            return
        if not cls.name:
            raise errors.PipelineError(f"pass class {cls.__qualname__} has an empty `name`",
                                       source=errors.source_text(),
                                       fix="give the class a unique `name`, the one pipeline strings use")
        old = REGISTRY.get(cls.name)
        if old is not None and (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
            raise errors.PipelineError(
                f"pass name '{cls.name}' is taken by {old.__module__}.{old.__qualname__}",
                source=errors.source_text(), fix=f"give {cls.__qualname__} another `name`")
        REGISTRY[cls.name] = cls

    def __post_init__(self) -> None:
        check_options(self)

    def check(self) -> None:
        """Raise ``ValueError`` if the options do not fit together (``tie``'s ``src`` and
        ``dst`` the same variable).  Each option's own constraints are declared in its
        annotation, ``Annotated[int, AtLeast(1)]`` (``passes/framework/options.py``), and checked
        before this; both run whenever the pass is made, and fail as a ``PipelineError``."""

    def rooted(self, roots: Sequence[Root]) -> "Pass":
        """This pass for the variables under ``roots`` only, named as there (see the module
        docstring): what ``bind(passes=...)`` runs in an object-mode transform."""
        if not roots:
            return self
        if not type(self).rootable:
            raise errors.PipelineError(
                f"pass '{self.spec()}' cannot run for one module's variables (its class does "
                "not declare rootable = True), so it cannot follow a module bound with it "
                "into an object-mode transform, where the variables of every argument share "
                "one program.", source=errors.source_text(),
                fix=f"make {type(self).__qualname__} touch only the variables under "
                    "self.roots, read their paths through self.relative(path), and set "
                    "rootable = True; or call the module outside the transform")
        rooted = copy.copy(self)
        ordered = tuple(sorted(set(roots), key=lambda r: (-len(r[0]), r)))
        object.__setattr__(rooted, "roots", ordered)
        return rooted

    def relative(self, path: Path) -> Path | None:
        """Program path ``path`` as this pass's options name it (relative to its root);
        None for a variable outside every root, which the pass leaves alone."""
        return relative_path(self.roots, path)

    def lifted_like(self) -> Mapping[str, str]:
        """Collections this pass creates variables in, each mapped to the collection whose
        lifting they follow: a lifted transform that names no filter for them lifts them as
        that one (LoRA's ``lora`` adapters are scanned and vmapped as ``params`` are), so a
        pass needs no change to the model's ``nn.scan``/``nn.vmap`` arguments."""
        return {}

    def supplies(self) -> frozenset[Key]:
        """Variables ``(collection, path)`` this pass provides itself: it replaces every
        read of them, so a call need not give them (``tie``'s ``dst``, which ``init`` never
        returns).  Tracing runs the model code before any pass, and the code's ``param``
        of a missing variable would fail there; for these, outside ``init``, the trace
        emits a read of the type the initializer would make instead, for the pass to
        replace.  In ``init`` they are created as usual (their initializers draw their
        keys).  A read that no pass replaces fails the call (``MissingVariableError``)."""
        return frozenset()

    def run(self, jaxpr: _jax.ClosedJaxpr, ctx: PassContext) -> _jax.ClosedJaxpr:
        raise NotImplementedError(f"pass {self.name} does not implement run()")

    def spec(self) -> str:
        """This pass as it appears in a pipeline string: ``cast-params{dtype=bfloat16}``."""
        opts = [f"{f.name}={_option_text(getattr(self, f.name))}" for f in option_fields(self)]
        return self.name + ("{" + ",".join(opts) + "}" if opts else "")


def _option_text(value: Any) -> str:
    return getattr(value, "name", None) or getattr(value, "__name__", None) or str(value)


def get_pass(name: str) -> type[Pass]:
    """The pass class registered as ``name`` (``"cast-params"``); ``PipelineError`` listing
    the registered names when there is none."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise errors.PipelineError(
            f"unknown pass '{name}'; registered passes: {', '.join(sorted(REGISTRY))}",
            source=errors.source_text(),
            fix="check the spelling, or import the module that defines the pass") from None

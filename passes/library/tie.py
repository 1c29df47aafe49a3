"""tie: weight tying -- variable ``dst`` is variable ``src``, and ``dst`` is never stored.

Every ``var_get`` of ``dst`` (a ``/``-separated path in ``collection``) becomes a read of
``src``, and every ``var_set`` of ``dst`` -- its creation in ``init`` -- is dropped, so
``init`` returns no ``dst`` and the pure function takes none.  Model code does not
change: an unembedding ``Dense_1/kernel`` tied to ``Embed_0/embedding`` computes with
the embedding table, as ``Embed.attend`` would.

**Types.**  ``dst`` is read as ``src`` when both have the same type, and as ``src.T``
when both are single 2-D arrays of one dtype and ``dst``'s shape is ``src``'s reversed
(``[V, D]`` embedding, ``[D, V]`` kernel).  ``transpose=true`` / ``transpose=false``
forces one of the two, for a square table (read as is when left to the shapes).  Any
other pair raises ``VariableShapeError`` at ``dst``'s use.

**Order.**  ``src`` must exist where ``dst`` is first read: given to the call, or created
earlier in the program (the embedding created before the unembedding is used).
``src`` or ``dst`` appearing nowhere is a ``MissingVariableError``, as is a read of
``dst`` before ``src`` is created.  The body of a lifted transform (``nn.scan``) runs the
program's passes too: a body that does not use ``dst`` is left as it is, a ``dst`` used
only in bodies is tied there, and one in a body that is not handed ``src`` is a
``MissingVariableError``.  Writes of ``dst`` are dropped wherever they are, so an update
of ``dst`` in a mutable collection is lost: update ``src``.

**Apply.**  ``apply`` takes the variables ``init`` returned, without ``dst``: the pass
supplies ``dst`` (``Pass.supplies``), so the trace reads it where the model code asks
for it, with the type its initializer would make, and this pass makes that a read of
``src``.

**With other passes.**  ``tie`` runs before the passes that change the values read
(``fake-quant``, ``stop-gradient``, ``cast-params``), whatever the written order: they
see ``dst``'s reads as reads of ``src`` (``stop-gradient{under=Dense_1}`` then freezes
nothing of the tied table).

Use as ``vj.functionalize(fn, passes="tie{src=Embed_0/embedding,dst=Dense_1/kernel}")``;
``notes/pass-library.md`` shows the IR.

Sharp edges:
  * Random keys: ``dst``'s initializer still draws its key in ``init`` (draws are never
    dropped), so the other parameters' values equal those of the untied model.
"""
from __future__ import annotations

import dataclasses
from typing import Annotated, Any

from varjax import _jax
from varjax.ir import errors, nested
from varjax.ir.primitives import Key, Path, VarType, bind_get, var_get_p, var_set_p
from varjax.passes.framework.base import Pass, PassContext
from varjax.passes.framework.options import Name, VariablePath
from varjax.passes.framework.rewrite import Region, Rule
from varjax.passes.library.stop_gradient import ReadRewriter, split_path


def _touches(jaxpr: _jax.ClosedJaxpr, at: Path) -> bool:
    """Whether the program reads or writes a variable under ``at``."""
    return any(e.primitive in (var_get_p, var_set_p) and e.params["path"][:len(at)] == at
               for e, _ in nested.walk_eqns(jaxpr))


def _type_of(eqn: _jax.JaxprEqn) -> VarType:
    """The type of the variable an equation reads or writes."""
    if eqn.primitive is var_get_p:
        return VarType(eqn.params["tree"], tuple(eqn.params["avals"]))
    return VarType(eqn.params["tree"], tuple(v.aval.update(weak_type=False) for v in eqn.invars))


def _transposes(src: VarType, dst: VarType) -> bool:
    """Both one 2-D array of one dtype, ``dst``'s shape ``src``'s reversed."""
    if src.tree != dst.tree or len(src.avals) != 1 or src.tree.children():
        return False
    a, b = src.avals[0], dst.avals[0]
    return a.ndim == 2 and b.ndim == 2 and a.dtype == b.dtype and a.shape[::-1] == b.shape


def relation(src: VarType, dst: VarType, transpose: bool | None) -> bool | None:
    """How ``dst`` is read from ``src``: True transposed, False as is, None not at all."""
    if transpose is None:
        return False if src == dst else (True if _transposes(src, dst) else None)
    if transpose:
        return True if _transposes(src, dst) else None
    return False if src == dst else None


@dataclasses.dataclass(frozen=True)
class TiedRead(Rule):
    """A read of ``dst`` becomes a read of ``src`` (transposed when ``transpose``)."""

    primitive = var_get_p
    dst: Key
    src: Key
    src_type: VarType
    transpose: bool

    def match(self, eqn: _jax.JaxprEqn) -> bool:
        return (eqn.params["collection"], eqn.params["path"]) == self.dst

    def rewrite(self, eqn: _jax.JaxprEqn, invals: list[Any], region: Region) -> list[Any]:
        collection, path = self.src
        outs = bind_get(collection, path, self.src_type.tree, self.src_type.avals)
        return [x.T for x in outs] if self.transpose else outs


@dataclasses.dataclass(frozen=True)
class DroppedWrite(Rule):
    """A write of ``dst`` is dropped: ``dst`` is never stored."""

    primitive = var_set_p
    dst: Key

    def match(self, eqn: _jax.JaxprEqn) -> bool:
        return (eqn.params["collection"], eqn.params["path"]) == self.dst

    def rewrite(self, eqn: _jax.JaxprEqn, invals: list[Any], region: Region) -> list[Any]:
        return []


@dataclasses.dataclass(frozen=True)
class Tie(Pass):
    """Weight tying: variable ``dst`` is read as ``src`` (transposed when its shape is
    reversed) and never stored (``tie{src=Embed_0/embedding,dst=Dense_1/kernel}``)."""

    name = "tie"
    summary = "variable `dst` is read as `src` (transposed when its shape is reversed) and never stored"
    # In init a parameter is read back after it is created; forward-stores would turn
    # that read into the created value before this pass saw it.  Passes that change the
    # values read run after it, so they see dst's reads as reads of src.
    before = ("fake-quant", "stop-gradient", "cast-params", "forward-stores", "discharge")
    rootable = True
    src: Annotated[str, VariablePath()]
    """The ``/``-separated path of the variable that is read (``Embed_0/embedding``)."""
    dst: Annotated[str, VariablePath()]
    """The ``/``-separated path of the variable read as ``src`` and never stored."""
    collection: Annotated[str, Name()] = "params"
    """The collection both variables are in."""
    transpose: bool | None = None
    """``True``/``False`` forces reading ``src`` transposed or as is; ``None`` decides by the
    shapes."""

    def check(self) -> None:
        if split_path(self.src) == split_path(self.dst):
            raise ValueError(f"src and dst are the same variable {self.src!r}")

    def supplies(self) -> frozenset[Key]:
        # Every read of dst becomes a read of src: apply needs no dst.
        return frozenset(dst for _, _, dst in self._pairs())

    def _pairs(self) -> list[tuple[Path, Key | None, Key]]:
        """``(root, src, dst)`` per root that holds ``dst`` (``Pass.rooted``; the whole
        program unrooted): the two variables' keys in the program.  ``src`` is None where
        the root cannot hold it (a submodule passed alone, tied to a variable outside it)."""
        src, dst = split_path(self.src), split_path(self.dst)
        pairs: list[tuple[Path, Key | None, Key]] = []
        for at, base in self.roots or (((), ()),):
            if dst[:len(base)] == base:
                inside = src[:len(base)] == base
                pairs.append((at, (self.collection, at + src[len(base):]) if inside else None,
                              (self.collection, at + dst[len(base):])))
        return pairs

    def run(self, jaxpr: _jax.ClosedJaxpr, ctx: PassContext) -> _jax.ClosedJaxpr:
        rules: list[Rule] = []
        for at, src, dst in self._pairs():
            if self.roots and not _touches(jaxpr, at):
                continue      # an argument the program never uses: nothing to tie there
            if src is None:
                raise errors.MissingVariableError(
                    f"tie: {self.dst} is in argument {errors.format_path(at)} and its source "
                    f"{self.src} is not, so the tied read would find no value.",
                    collection=self.collection, path=dst[1], **errors.where(),
                    fix="pass the module that holds both variables")
            checked = self._check(jaxpr, ctx, src, dst)
            if checked is None:       # a lifted body that does not use dst
                continue
            src_type, transpose = checked
            rules += [TiedRead(dst, src, src_type, transpose), DroppedWrite(dst)]
        if not rules:
            return jaxpr
        ctx.count(self.name, "tied", len(rules) // 2)
        return ReadRewriter(rules).run(jaxpr)

    def _check(self, jaxpr: _jax.ClosedJaxpr, ctx: PassContext, src: Key, dst: Key
               ) -> tuple[VarType, bool] | None:
        """``src``'s type and whether ``dst`` reads it transposed; raises on a program
        where the tie cannot hold (see the module docstring).  None where this jaxpr does
        not use ``dst`` but the program may: a lifted transform's body sees only the
        variables handed in, and a program whose bodies alone use ``dst`` had them tie it
        in their own pipelines."""
        src_type: VarType | None = ctx.variables.get(src)
        created = src_type is not None
        uses: list[_jax.JaxprEqn] = []
        early: _jax.JaxprEqn | None = None     # a read of dst before src exists
        for eqn, _ in nested.walk_eqns(jaxpr):   # pre-order: program order, bodies inline
            if eqn.primitive is not var_get_p and eqn.primitive is not var_set_p:
                continue
            key = (eqn.params["collection"], eqn.params["path"])
            if key == src:
                src_type = src_type or _type_of(eqn)
                created = created or eqn.primitive is var_set_p
            elif key == dst:
                uses.append(eqn)
                if eqn.primitive is var_get_p and not created and early is None:
                    early = eqn
        if not uses and (ctx.region or dst in ctx.asked):   # used only in lifted bodies,
            return None                                       # which tied it themselves
        if src_type is None and ctx.region:
            raise errors.MissingVariableError(
                f"tie: {self.dst} is used in the body of a lifted transform that its source "
                f"{self.src} is not handed to, so the tied read would find no value.",
                collection=self.collection, path=src[1], **self._where(jaxpr, uses[0]),
                fix="tie variables that both live inside the lifted module, or both outside it")
        if src_type is None:
            raise errors.MissingVariableError(
                f"tie: source variable {self.src} of collection '{self.collection}' is neither "
                "given nor created by the program, so there is nothing to tie "
                f"{self.dst} to.", collection=self.collection, path=src[1],
                **self._where(jaxpr, uses[0] if uses else None),
                fix="name src as the variables dict spells it (module path / name), "
                    "e.g. tie{src=Embed_0/embedding,dst=...}")
        if not uses:
            raise errors.MissingVariableError(
                f"tie: variable {self.dst} of collection '{self.collection}' is never read or "
                "written by the program, so nothing is tied to "
                f"{self.src}.", collection=self.collection, path=dst[1],
                **self._where(jaxpr, None),
                fix="name dst as the variables dict of the untied model spells it, "
                    "e.g. tie{src=...,dst=Dense_1/kernel}")
        if early is not None:
            raise errors.MissingVariableError(
                f"tie: {self.dst} is read before its source {self.src} is created, so the "
                "tied read would find no value.", collection=self.collection, path=dst[1],
                **self._where(jaxpr, early),
                fix=f"create {self.src} before {self.dst} is first used (call the module "
                    "that owns it first), or tie the other way round")
        transpose = None
        for eqn in uses:
            transpose = relation(src_type, _type_of(eqn), self.transpose)
            if transpose is None:
                raise errors.VariableShapeError(
                    f"tie: {self.dst} ({_type_of(eqn).describe()}) cannot be read as "
                    f"{self.src} ({src_type.describe()}): {self._rule()}.",
                    collection=self.collection, path=dst[1], **self._where(jaxpr, eqn),
                    fix="tie variables of one type, or a 2-D one to its transpose")
        assert transpose is not None
        return src_type, transpose

    def _rule(self) -> str:
        if self.transpose is None:
            return "the types must be equal, or both 2-D with one shape the other reversed"
        if self.transpose:
            return "transpose=true needs both 2-D of one dtype, one shape the other reversed"
        return "transpose=false needs equal types"

    @staticmethod
    def _where(jaxpr: _jax.ClosedJaxpr, eqn: _jax.JaxprEqn | None) -> dict[str, Any]:
        if eqn is None:
            return errors.where()
        with errors.enclosing(*(e.source_info for e in nested.enclosing_eqns(jaxpr, eqn))):
            return errors.where(eqn.source_info)

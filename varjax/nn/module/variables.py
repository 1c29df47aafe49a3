"""The variable API on ``self``: ``param``, ``variable``, ``sow``, ``make_rng``, ...

Each call is the path-based operation of ``varjax.trace.variable_api`` (``param_at``,
``variable_at``, ``draw_at``, ...) at ``module path + (name,)`` on the active trace,
after the module's name reservation (``Naming._reserve_variable``).  A module made by
``bind`` and used from outside any trace reads its root's variables directly, and
runs anything that creates or writes a variable as a one-off traced call (``_eager``).
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Self

import jax

from varjax.ir import axis_metadata, errors, filters, streams
from varjax.ir.primitives import Path, VarType
from varjax.ir.typing import PyTree
from varjax.nn.module.lifecycle import Lifecycle
from varjax.trace import type_checks, variable_api
from varjax.trace.context import TraceContext, site
from varjax.trace.variable_api import Variable
from varjax.trace.variable_dicts import unflatten_variables, variable_values


class VariableAPI(Lifecycle):
    """The variables, RNG streams and collection flags a module reads and writes."""

    def _ctx(self, api: str) -> TraceContext:
        """The trace this bound module's operation ``api`` runs under."""
        if self.scope is None:
            raise errors.UnboundModuleError(
                f"{api} needs a bound module, but {self._label()} is not bound.",
                **site(about=self),
                fix="call the module through init / apply, or use module.bind(variables)")
        return self.scope.context(self, api)

    def _eager(self, op: Callable[[Self], Any]) -> Any:
        """Runs a variable operation of a ``bind`` module from outside any trace."""
        def run(m: VariableAPI) -> Any:
            m._state.eager_op = True          # declared from outside, not in a method
            try:
                return op(m)
            finally:
                m._state.eager_op = False
        return self._run_bound(run, (), {}, method=False)

    def param(self, name: str, init_fn: Callable[..., Any], *init_args: Any, unbox: bool = True,
              **init_kwargs: Any) -> PyTree:
        """Parameter ``name`` of this module, created with
        ``init_fn(key, *init_args, **init_kwargs)``.

        An existing parameter is checked against ``init_fn``'s abstract output (boxes
        aside: unboxed values stand for a boxing ``init_fn``'s, as in Linen).  With
        ``unbox``, a boxed value (``nn.with_partitioning``) is returned without its boxes,
        and without Linen's sharding constraint: the ``shard-variables`` pass puts that on
        the variable's reads and writes in the IR.
        """
        if init_kwargs:
            init_fn = functools.partial(init_fn, **init_kwargs)
        if self.scope is not None and self.scope.eager():
            if self.scope.root.has("params", self._path(name)):
                value = self.scope.root.read("params", self._path(name))
                type_checks.check_type("params", self._path(name), VarType.of(value),
                                       type_checks.expected_type(init_fn, init_args, True), self)
            else:
                value = self._eager(lambda m: m.param(name, init_fn, *init_args, unbox=False))
        else:
            ctx = self._ctx("Module.param")
            self._reserve_variable("parameter", "params", name)
            value = variable_api.param_at(ctx, self._path(name), init_fn, init_args)
        return axis_metadata.unbox(value, apply_constraint=False) if unbox else value

    def variable(self, col: str, name: str, init_fn: Callable[..., Any] | None = None,
                 *init_args: Any, unbox: bool = True, **init_kwargs: Any) -> Variable:
        """A handle (``.value``) on variable ``name`` of ``col`` in this module, created
        with ``init_fn(*init_args, **init_kwargs)``.  With ``unbox``, ``.value`` reads a
        boxed value without its boxes (as in ``param``) and a write keeps them."""
        if init_kwargs:
            init_fn = functools.partial(init_fn, **init_kwargs)
        if self.scope is not None and self.scope.eager():
            if not self.scope.root.has(col, self._path(name)):
                self._eager(lambda m: m.variable(col, name, init_fn, *init_args))
            return Variable.backed(self.scope.root, col, self._path(name), unbox)
        ctx = self._ctx("Module.variable")
        self._reserve_variable("variable", col, name)
        return variable_api.variable_at(ctx, col, self._path(name), init_fn, init_args, unbox)

    def has_variable(self, col: str, name: str) -> bool:
        if self.scope is not None and self.scope.eager():
            return self.scope.root.has(col, self._path(name))
        return variable_api.has_at(self._ctx("Module.has_variable"), col, self._path(name))

    def get_variable(self, col: str, name: str, default: PyTree = None) -> PyTree:
        if not self.has_variable(col, name):
            return default
        if self.scope.eager():
            return self.scope.root.read(col, self._path(name))
        return variable_api.read_at(self._ctx("Module.get_variable"), col, self._path(name))

    def put_variable(self, col: str, name: str, value: PyTree) -> None:
        if self.scope is not None and self.scope.eager():
            return self._eager(lambda m: m.put_variable(col, name, value))
        variable_api.write_at(self._ctx("Module.put_variable"), col, self._path(name), value)

    def sow(self, col: str, name: str, value: PyTree,
            reduce_fn: Callable[[Any, Any], Any] = variable_api.append,
            init_fn: Callable[[], Any] = tuple) -> bool:
        """Store ``value`` if ``col`` is mutable (Linen's ``sow``); False if not."""
        if self.scope is not None and self.scope.eager():
            return self._eager(lambda m: m.sow(col, name, value, reduce_fn, init_fn))
        ctx = self._ctx("Module.sow")
        if ctx.is_mutable(col) and not variable_api.has_at(ctx, col, self._path(name)):
            self._reserve_variable("sown variable", col, name, anywhere=True)
        return variable_api.sow_at(ctx, col, self._path(name), value, reduce_fn, init_fn)

    def perturb(self, name: str, value: jax.Array, collection: str = "perturbations") -> jax.Array:
        """``value`` plus a zero-initialized variable, whose gradient is d loss / d value."""
        if self.is_mutable_collection(collection) and not self.has_variable(collection, name):
            self.put_variable(collection, name, jax.numpy.zeros_like(value))
        if self.has_variable(collection, name):
            return value + self.get_variable(collection, name)
        return value

    def make_rng(self, name: str = streams.PARAMS) -> jax.Array:
        """A fresh key from stream ``name``; every call gives a different key.  A stream that
        was not given falls back to ``default`` (a ``vj.Rngs`` seed, as in NNX), then to
        ``params`` (as in Linen, so ``init(key, x, train=True)`` works); with none of them,
        ``MissingRngError``."""
        if self.scope is not None and self.scope.eager():
            return self._eager(lambda m: m.make_rng(name))
        ctx = self._ctx("Module.make_rng")
        return variable_api.draw_at(ctx, name, self.scope.path, (streams.DEFAULT, streams.PARAMS))

    def has_rng(self, name: str) -> bool:
        if self.scope is not None and self.scope.eager():
            return self.scope.root.has_rng(name)
        return name in self._ctx("Module.has_rng").rng_streams

    def is_mutable_collection(self, col: str) -> bool:
        if self.scope is not None and self.scope.eager():
            return filters.matches(self.scope.root.mutable, col)
        return self._ctx("Module.is_mutable_collection").is_mutable(col)

    def is_initializing(self) -> bool:
        if self.scope is not None and self.scope.eager():
            return False
        return self._ctx("Module.is_initializing").initializing

    @property
    def path(self) -> Path:
        """The names from the root module to this one (``()`` for the root)."""
        if self.scope is None:
            raise errors.UnboundModuleError(
                f"{self._label()} has no path: it is not bound.", **site(about=self),
                fix="read .path inside a method called through init/apply, or on a module made by bind")
        return self.scope.path

    @property
    def variables(self) -> dict[str, Any]:
        """This module's variables as ``{collection: {name: value}}`` (current values)."""
        prefix = self.path
        if self.scope.eager():
            flat = variable_values(self.scope.root.variables)
        else:
            ctx = self._ctx("Module.variables")
            flat = {k: variable_api.read_at(ctx, *k) for k in ctx.variables if k[1][:len(prefix)] == prefix}
        return unflatten_variables({(c, p[len(prefix):]): v for (c, p), v in flat.items()
                                    if p[:len(prefix)] == prefix and len(p) > len(prefix)})

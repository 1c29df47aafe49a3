"""``Module``: Flax Linen's module system, on varjax's IR.

A module is a frozen dataclass: a template holding construction arguments and
no state.  ``init`` / ``apply`` are ``vj.functionalize`` of a function that
clones the template, binds the clone to the running trace and calls the
method.  A bound module has a ``Scope`` (its root and its path); every
``self.param`` / ``self.variable`` / ``self.make_rng`` is the path-based
operation of ``varjax.trace.variable_api`` on the active trace, so the variables a module
touches are ordinary ``var_get`` / ``var_set`` equations whose path starts
with the module path (``params:Dense_0/kernel``).  Each wrapped method call also
enters ``jax.named_scope(<module name>)``, so every equation it traces carries
the module in its name stack.

Lifecycle (see ``notes/modules.md``):
  * submodules get their parent from the module whose ``setup`` or ``@compact``
    method is running (a thread-local stack); in ``setup`` they are named by
    the attribute they are assigned to (``layers_0`` for lists), in a compact
    method by class and construction order (``Dense_0``), or by ``name=``;
  * ``setup`` runs lazily, on the first method call or attribute miss of a
    bound module; top-level templates never run it;
  * a module bound by ``init``/``apply`` may be used only under that trace
    (``InvalidScopeError`` afterwards);
  * ``bind`` makes a root that owns concrete variables (``binding.BoundRoot``).

The class is assembled from one file per concern; ``README.md`` says what lives where.
"""
from varjax.nn.binding import Scope
from varjax.nn.dtypes import merge_param
from varjax.nn.module.definition import CompactNameScope, Module
from varjax.nn.module.entry import (
                                    DEFAULT_INIT_MUTABLE,
                                    apply,
                                    capture_call_intermediates,
                                    init,
                                    init_with_output,
)
from varjax.nn.module.interception import (
                                    Interceptor,
                                    InterceptorContext,
                                    disable_named_call,
                                    enable_named_call,
                                    intercept_methods,
                                    override_named_call,
)
from varjax.nn.module.lifecycle import compact, compact_name_scope, nowrap
from varjax.nn.module.naming import share_scope
from varjax.nn.module.tabulation import tabulate

__all__ = ["DEFAULT_INIT_MUTABLE", "CompactNameScope", "Interceptor", "InterceptorContext",
           "Module", "Scope", "apply", "capture_call_intermediates", "compact",
           "compact_name_scope", "disable_named_call", "enable_named_call", "init",
           "init_with_output", "intercept_methods", "merge_param", "nowrap",
           "override_named_call", "share_scope", "tabulate"]

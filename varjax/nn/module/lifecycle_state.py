"""What a module instance keeps about its own lifecycle.

The dataclass fields of a module are its construction arguments; everything the
lifecycle tracks besides them (is setup done, for which root version, which names
this call reserved) lives in one ``ModuleState`` per instance, so the frozen-field
rule (``FrozenModuleError``) never has to make exceptions for bookkeeping.
"""
from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class ModuleState:
    """The per-instance lifecycle state of a module (``module._state``)."""

    in_setup: bool = False
    setup_done: bool = False
    setup_version: int = -1
    compact_depth: int = 0
    # A bound module's variable operation run from outside any trace (``VariableAPI._eager``).
    eager_op: bool = False
    cursor: dict[str, int] = dataclasses.field(default_factory=dict)
    # Reserved names (Linen's reservations): submodule names, and (collection, name) of
    # variables, declared by setup and by the current call of the compact method (which
    # starts from setup's).  A submodule's name is taken in every collection.
    setup_names: set[str] = dataclasses.field(default_factory=set)
    call_names: set[str] = dataclasses.field(default_factory=set)
    setup_vars: set[tuple[str, str]] = dataclasses.field(default_factory=set)
    call_vars: set[tuple[str, str]] = dataclasses.field(default_factory=set)
    setup_attrs: list[str] = dataclasses.field(default_factory=list)
    # Lifted classes (``_varjax_lift_class``) whose transform is running on this instance.
    lifting: set[type] = dataclasses.field(default_factory=set)
    # Set by a transformed method (``nn.jit`` on a method) for the lift it is about to
    # call, which reads and clears it: unlike a direct transform's bodies (``nn.cond``'s
    # functions, run on Linen's clone with its own names), a transformed method keeps the
    # submodule names its caller reserved.
    method_lift: bool = False


@dataclasses.dataclass(frozen=True)
class SetupSnapshot:
    """What ``setup`` made on one module, kept while a lifted body runs setup again."""

    done: bool
    version: int
    attrs: dict[str, Any]
    order: list[str]
    setup_names: set[str]
    setup_vars: set[tuple[str, str]]
    call_names: set[str]
    call_vars: set[tuple[str, str]]


class _Unspecified:
    def __repr__(self) -> str:
        return "<parent from context>"


# The default of ``parent=``: take the parent from the running module
# (``lifecycle.module_stack``).
UNSPECIFIED = _Unspecified()

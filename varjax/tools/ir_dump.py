"""``vj.dump``: the effectful IR of a call, then the IR after each pass.

``dump(target, *args, variables=..., ...)`` traces ``target`` for those
arguments (the ``apply`` trace, like ``.jaxpr()``), runs its pipeline, plus any
``passes``, on the result with a ``Recorder`` watching, and returns
``[('effectful', text), (pass_name, text), ...]``.  With ``to=DIR`` the same
texts are also written as numbered files, with a unified diff per pass that
changed the IR, in a new run directory under ``DIR`` (``Dump``'s layout, the one
``VARJAX_DUMP_DIR`` produces for every compiled call).

An object-mode step -- a function whose arguments hold objects (NNX modules,
``vj.Variable``s, ``Rngs``, bound modules), or a ``vj.jit``/``nnx.jit`` of one -- is traced
as the object-mode transforms trace it (``varjax.objects.inspection``): its ``var_get``/
``var_set`` name each Variable by its path in the arguments (``params:model/linear/kernel``),
and a jitted step's own ``passes=`` run before the extra ones.  An NNX module given as the
target is the step ``model(*args)``.  Its variables come from its
objects, so ``variables``/``rngs``/``mutable`` are refused there; nothing runs and nothing is
written back to the objects.

The run is not cached and changes nothing in ``target``'s caches.  If a pass
fails, the files written so far stay and the error is raised.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Sequence

from varjax.ir import errors
from varjax.ir.typing import CollectionFilter, RngsLike, VariableDict
from varjax.objects import inspection
from varjax.passes import Dump, Pass, Pipeline, Recorder
from varjax.tools.target import as_functionalized, is_linen_target


def dump(target: Callable[..., Any], *args: Any, variables: VariableDict | None = None,
         rngs: RngsLike | None = None, mutable: CollectionFilter = False,
         passes: Sequence[str | Pass] | str | None = None,
         to: str | os.PathLike | None = None, source: bool = True,
         **kwargs: Any) -> list[tuple[str, str]]:
    """The IR of ``target(*args)`` before and after each pass (see the module docstring).

    ``target`` is a function using ``vj.*``, a ``vj.functionalize``-d function, a
    ``Module`` or a method of one, or an object-mode step (see the module docstring).
    ``passes`` are added to its pipeline.  ``source=False`` leaves source lines out
    (module name stacks stay).
    """
    extra = [] if passes is None else [passes] if isinstance(passes, str) else list(passes)
    recorder = Recorder(source=source)
    watchers = [recorder] + ([Dump(to, source=source)] if to is not None else [])
    if not is_linen_target(target) and inspection.holds_objects(target):
        target, args = inspection.called, (target, *args)     # an NNX module: its __call__
    if not is_linen_target(target) and inspection.is_object_call(target, args, kwargs):
        given = [name for name, value, default in (("variables", variables, None),
                                                   ("rngs", rngs, None),
                                                   ("mutable", mutable, False))
                 if value is not default]
        if given:
            raise errors.TransformError(
                f"vj.dump: {', '.join(given)} given for an object-mode step; its variables, "
                "keys and mutability come from the objects it is passed.", **errors.where(),
                fix="leave them out; pass the objects (a module, its Rngs) as arguments")
        inspection.run_pipeline(target, args, kwargs, extra, watchers)
        return recorder.entries
    fn = as_functionalized(target)
    pipeline = Pipeline([*fn.pipeline.passes, *extra], verify=fn.pipeline.verify,
                        instrumentations=watchers)
    fn.run_pipeline(*args, variables=variables, rngs=rngs, mutable=mutable, pipeline=pipeline, **kwargs)
    return recorder.entries

"""Linen's fp8 matmul modules, present by name only: building one raises ``NotProvidedError``.

Linen's fp8 ops (``Fp8DotGeneralOp``, ``Fp8DirectDotGeneralOp``, ``Fp8Einsum``,
``NANOOFp8DotGeneralOp``, ``Fp8DotGeneral``) quantize a matmul's operands with scales
from an amax history kept in the ``_overwrite_with_gradient`` collection, whose
"gradient" is the new value.  That calls for an optimizer that overwrites rather
than adds, and for fp8 hardware to be worth it; varjax has neither yet.  The names
exist so ported modules that mention them in a default field import; passing one
as ``dot_general_cls`` fails at the line that builds it.
"""
from __future__ import annotations

from varjax.trace.unprovided import unprovided_class

__all__ = ["Fp8DirectDotGeneralOp", "Fp8DotGeneral", "Fp8DotGeneralOp", "Fp8Einsum", "NANOOFp8DotGeneralOp"]

_WHY = ("fp8 delayed scaling keeps amax histories in the '_overwrite_with_gradient' collection, whose "
        "gradient replaces the value; varjax has no such update rule.")
_FIX = "leave dot_general_cls unset (full-precision matmul), or quantize with a varjax pass over the IR."

Fp8DotGeneralOp = unprovided_class("Fp8DotGeneralOp", _WHY, _FIX, __name__)
Fp8DirectDotGeneralOp = unprovided_class("Fp8DirectDotGeneralOp", _WHY, _FIX, __name__)
NANOOFp8DotGeneralOp = unprovided_class("NANOOFp8DotGeneralOp", _WHY, _FIX, __name__)
Fp8Einsum = unprovided_class("Fp8Einsum", _WHY, _FIX, __name__)
Fp8DotGeneral = unprovided_class("Fp8DotGeneral", _WHY, _FIX, __name__)

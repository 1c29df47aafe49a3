"""Transitional: the table of higher-order primitives moved to ``varjax/nested.py``.

``varjax.nested`` is now the one owner of "the bodies of a higher-order equation",
with one policy for unknown primitives (see its docstring).  These names remain for
the importers not yet switched (``discharge``, ``varjax/tools``); new code imports
``varjax.nested``.
"""
from varjax.nested import TABLE as TABLE
from varjax.nested import Hop as Hop
from varjax.nested import bodies as bodies
from varjax.nested import closed as closed
from varjax.nested import const_free as const_free
from varjax.nested import passthrough as passthrough
from varjax.nested import unsupported as unsupported
from varjax.nested import with_bodies as with_bodies

"""Transitional: the nested-jaxpr walkers moved to ``varjax/nested.py``.

``varjax.nested`` is now the one owner of "the bodies of a higher-order equation"
(the printer, in the IR core, shares it).  These names remain for the importers not
yet switched (``discharge``, ``varjax/tools``, some tests); new code imports
``varjax.nested``.  ``enclosing`` is now ``nested.enclosing_eqns``.
"""
from varjax.nested import AnyJaxpr as AnyJaxpr
from varjax.nested import first_variable as first_variable
from varjax.nested import open_jaxpr as open_jaxpr
from varjax.nested import subjaxprs as subjaxprs
from varjax.nested import walk_eqns as walk_eqns

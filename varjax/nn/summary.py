"""``nn.summary``: Linen's module path for the parameter table, ``tabulate``.

The table is built in ``varjax/nn/module/tabulation.py`` from varjax's IR summary; this
module only gives it Linen's import path (``from flax.linen.summary import tabulate``).
"""
from varjax.nn.module import tabulate as tabulate

__all__ = ["tabulate"]

"""``nn.transforms``: the lifted transforms under the module path Linen code imports them from.

``nn.transforms.scan`` (and ``from flax.linen.transforms import vmap``) resolve to
``varjax.transforms``; see ``notes/transforms.md``.  Linen's lifting internals in that
module (``lift_transform``, ``get_module_scopes``, ...) have no counterpart: varjax
lifts through ``varjax.lifting`` instead.
"""
from varjax.transforms import *  # noqa: F403
from varjax.transforms import __all__ as __all__  # noqa: F401

"""``nn.transforms``: the lifted transforms under the module path Linen code imports them from.

``nn.transforms.scan`` (and ``from flax.linen.transforms import vmap``) resolve to
``varjax.transforms``; see ``notes/transforms.md``.  Linen's lifting internals in that
module (``lift_transform``, ``get_module_scopes``, ...) have no counterpart: varjax
lifts through ``varjax.lifting.region`` instead.

``add_metadata_axis`` is Linen's helper for boxed metadata (``nn.Partitioned``) across a
hand-written transform boundary: the target sees its boxes without an axis and stores
them with it, as ``nn.vmap``/``nn.scan`` with ``metadata_params`` do.  It is
``nn.map_variables``, once per collection.
"""
from typing import Any, Mapping

from varjax.ir.axis_metadata import add_axis, remove_axis
from varjax.ir.typing import CollectionFilter, Target
from varjax.nn.frozen_dict import FrozenDict
from varjax.transforms import *  # noqa: F403
from varjax.transforms import __all__ as _lifted
from varjax.transforms import map_variables

__all__ = [*_lifted, "add_metadata_axis"]


def add_metadata_axis(target: Target, variable_axes: Mapping[CollectionFilter, int | None] = FrozenDict(),
                      metadata_params: Mapping[str, Any] = FrozenDict()) -> Target:
    """``target`` (a Module class or a function of a module) whose boxed variables of each
    collection in ``variable_axes`` lose the metadata axis at its index on the way in
    and gain it on the way out (``AxisMetadata.remove_axis`` / ``add_axis`` with
    ``metadata_params``)."""
    params = dict(metadata_params)
    for collection, axis in variable_axes.items():
        target = map_variables(target, collection,
                               trans_in_fn=lambda tree, axis=axis: remove_axis(tree, axis, params),
                               trans_out_fn=lambda tree, axis=axis: add_axis(tree, axis, params),
                               mutable=True)
    return target

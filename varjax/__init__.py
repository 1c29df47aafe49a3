"""varjax: neural-network variables as effects in the jaxpr.

Trace stateful code into a jaxpr whose variable reads, writes and RNG draws
are effectful primitives; rewrite it with passes; functionalize it per
collection.  This file is the whole public API.
"""
import os as _os

from varjax import _jax

# Source lines in errors and dumps point at user code, never at varjax itself.
_jax.exclude_from_user_frames(_os.path.dirname(__file__))
_jax.exclude_from_user_frames(_os.path.join(_os.path.dirname(_os.path.dirname(__file__)), "passes"))

from varjax import errors as errors  # noqa: E402
from varjax.filters import DenyList as DenyList  # noqa: E402
from varjax.scope import (  # noqa: E402
    Variable as Variable,
    has_variable as has_variable,
    is_initializing as is_initializing,
    is_mutable_collection as is_mutable_collection,
    make_rng as make_rng,
    param as param,
    sow as sow,
    variable as variable,
)
from varjax.functionalize import Functionalized as Functionalized  # noqa: E402
from varjax.functionalize import functionalize as functionalize  # noqa: E402
from varjax import passes as passes  # noqa: E402

"""varjax: neural-network variables as effects in the jaxpr.

Trace stateful code into a jaxpr whose variable reads, writes and RNG draws
are effectful primitives; rewrite it with passes; functionalize it per
collection.  This file is the whole public API.
"""
from varjax import errors as errors
from varjax import passes as passes
from varjax.axis_metadata import PARTITION_NAME as PARTITION_NAME
from varjax.caches import clear_caches as clear_caches
from varjax.caches import set_cache_size as set_cache_size
from varjax.filters import DenyList as DenyList
from varjax.functionalize import Functionalized as Functionalized
from varjax.functionalize import functionalize as functionalize
from varjax.lifting import from_tree as from_tree
from varjax.lifting import lift as lift
from varjax.lifting import to_tree as to_tree
from varjax.objects.capture import capture as capture
from varjax.objects.metadata import transform_metadata as transform_metadata
from varjax.objects.state import GraphDef as GraphDef
from varjax.objects.state import merge as merge
from varjax.objects.state import split as split
from varjax.objects.state import state as state
from varjax.objects.state import update as update
from varjax.printing import pretty as pretty
from varjax.rngs import Rngs as Rngs
from varjax.rngs import RngStream as RngStream
from varjax.rngs import reseed as reseed
from varjax.scope import Variable as Variable
from varjax.scope import has_variable as has_variable
from varjax.scope import is_initializing as is_initializing
from varjax.scope import is_mutable_collection as is_mutable_collection
from varjax.scope import make_rng as make_rng
from varjax.scope import param as param
from varjax.scope import sow as sow
from varjax.scope import variable as variable
from varjax.tools.dataflow import dataflow as dataflow
from varjax.tools.dataflow import dead_params as dead_params
from varjax.tools.ir_dump import dump as dump
from varjax.transforms import *  # noqa: F403  (vmap, scan, ...: the lifted transforms)

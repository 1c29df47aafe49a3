"""Pooling: ``pool``, ``max_pool``, ``avg_pool``, ``min_pool``, where flax.nnx keeps them.

flax.nnx re-exports Linen's pooling functions; they hold no variables, so here they are
``varjax.functional.pooling``'s functions, the same objects ``varjax.nn`` exports: one
implementation for both frontends (padding and ``count_include_pad`` rules there).
"""
from varjax.functional.pooling import avg_pool as avg_pool
from varjax.functional.pooling import max_pool as max_pool
from varjax.functional.pooling import min_pool as min_pool
from varjax.functional.pooling import pool as pool

__all__ = ["pool", "max_pool", "avg_pool", "min_pool"]

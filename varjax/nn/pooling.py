"""Pooling: ``pool``, ``max_pool``, ``avg_pool``, ``min_pool``, where Linen keeps them.

They hold no variables, so they are ``varjax.functional.pooling``'s functions, shared with
``varjax.nnx``; see that module for the padding and ``count_include_pad`` rules.
"""
from varjax.functional.pooling import avg_pool as avg_pool
from varjax.functional.pooling import max_pool as max_pool
from varjax.functional.pooling import min_pool as min_pool
from varjax.functional.pooling import pool as pool

__all__ = ["pool", "max_pool", "avg_pool", "min_pool"]

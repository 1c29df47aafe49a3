"""``nnx.metrics``: running metrics as NNX objects whose accumulators are ``MetricState``
Variables, so a metric updated inside ``nnx.jit`` keeps its totals, as any module's
Variables do.

Each update and compute is flax.nnx's arithmetic, in its order and dtypes (a float32
total and an int32 count), so the values and the Variables equal flax.nnx's bit for bit.
That arithmetic mixes dtypes on purpose (a float32 total of bool or int values, divided
by an int count) and broadcasts masks, so it runs under JAX's standard dtype promotion
and rank broadcasting whatever the caller's setting (``_mixed``): a user's strict
promotion is for the user's own arithmetic, and would otherwise refuse every metric.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NoReturn, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from varjax.ir import errors
from varjax.ir.typing import Filter, PyTree
from varjax.nnx.graph import split
from varjax.nnx.pytree import Pytree
from varjax.nnx.variablelib import Variable

__all__ = ["MetricState", "Metric", "Average", "Accuracy", "Welford", "Statistics",
           "MultiMetric"]

F = TypeVar("F", bound=Callable[..., Any])


def _mixed(method: F) -> F:
    """Runs ``method`` under standard promotion and rank broadcasting (module docstring)."""
    @functools.wraps(method)
    def run(*args: Any, **kwargs: Any) -> Any:
        with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):
            return method(*args, **kwargs)
    return run  # type: ignore[return-value]


class MetricState(Variable):
    """A metric's accumulator (collection ``MetricState``)."""

    __slots__ = ()


class Metric(Pytree):
    """A running metric: ``update(**kwargs)`` accumulates in place, ``compute()`` reads the
    value, ``reset()`` starts again.  Subclasses define all four (``__init__`` too)."""

    def __init__(self) -> None:
        raise NotImplementedError("Must override `__init__()` method.")

    def reset(self) -> None:
        raise NotImplementedError("Must override `reset()` method.")

    def update(self, **kwargs: Any) -> None:
        raise NotImplementedError("Must override `update()` method.")

    def compute(self) -> PyTree:
        raise NotImplementedError("Must override `compute()` method.")

    def split(self, *filters: Filter) -> tuple:
        return split(self, *filters)


def _bad(what: str, fix: str) -> NoReturn:
    """Bad arguments to a metric: a ``ValueError`` (as flax.nnx raises) at the user's line."""
    raise errors.ConfigError(what, **errors.where(), fix=fix)


def _argument(metric: Any, kwargs: dict) -> Any:
    if metric.argname not in kwargs:
        raise TypeError(f"{type(metric).__name__}.update: expected keyword argument "
                        f"'{metric.argname}' (the name given to the constructor).")
    return kwargs[metric.argname]


class Average(Metric):
    """The mean of every value given to ``update(<argname>=...)``, optionally masked."""

    def __init__(self, argname: str = "values"):
        self.argname = argname
        self.total = MetricState(jnp.array(0, dtype=jnp.float32))
        self.count = MetricState(jnp.array(0, dtype=jnp.int32))

    def reset(self) -> None:
        self.total[...] = jnp.array(0, dtype=jnp.float32)
        self.count[...] = jnp.array(0, dtype=jnp.int32)

    @_mixed
    def update(self, mask: jax.Array | None = None, **kwargs: Any) -> None:
        """Adds ``kwargs[argname]`` (a number counts once, an array each element; with
        ``mask``, broadcastable to it, only the elements where it is true)."""
        values = _argument(self, kwargs)
        if isinstance(values, (int, float)):
            if mask is not None:
                _bad(f"Average.update: with a mask, {self.argname} must be an array, got a "
                     "Python number.", f"pass {self.argname}=jnp.asarray(...)")
            self.total[...] += values
            self.count[...] += 1
        elif mask is None:
            self.total[...] += values.sum()
            self.count[...] += values.size
        else:
            self.total[...] += (values * mask.astype(values.dtype)).sum()
            self.count[...] += mask.sum().astype(self.count[...].dtype)

    @_mixed
    def compute(self) -> jax.Array:
        """The average (NaN before any update)."""
        return self.total[...] / self.count[...]


class Accuracy(Average):
    """The fraction of predictions equal to the labels: ``logits`` argmax-ed on the last
    axis (multi-class), or ``logits >= threshold`` against ``labels > 0`` (binary)."""

    def __init__(self, threshold: float | None = None, *args: Any, **kwargs: Any):
        if threshold is not None and not isinstance(threshold, float):
            raise TypeError(f"Accuracy: threshold must be a float, got "
                            f"{type(threshold).__name__}.")
        self.threshold = threshold
        super().__init__(*args, **kwargs)

    def update(self, *, logits: jax.Array, labels: jax.Array,  # type: ignore[override]
               mask: jax.Array | None = None, **_: Any) -> None:
        binary = self.threshold is not None
        if logits.ndim != labels.ndim + (0 if binary else 1):
            kind, want = ("binary", "logits.ndim == labels.ndim") if binary else \
                ("multi-class", "logits.ndim == labels.ndim + 1")
            _bad(f"Accuracy.update ({kind}): expected {want}, got {logits.ndim} and "
                 f"{labels.ndim}.", "pass Accuracy(threshold=...) for binary labels, none for "
                 "class indices")
        if labels.dtype in (jnp.int64, np.int32, np.int64):
            labels = jnp.astype(labels, jnp.int32)
        else:
            _bad(f"Accuracy.update: labels must be int32 (or int64) class indices, got "
                 f"{labels.dtype}.", "labels.astype(jnp.int32)")
        correct = (logits >= self.threshold) == (labels > 0) if binary else \
            logits.argmax(axis=-1) == labels
        super().update(values=correct, mask=mask)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Statistics:
    """What ``Welford.compute`` returns."""

    mean: jax.Array
    standard_error_of_mean: jax.Array
    standard_deviation: jax.Array


class Welford(Metric):
    """The running mean, standard deviation and standard error of the values given to
    ``update(<argname>=...)``, by Welford's algorithm (one pass, numerically stable)."""

    def __init__(self, argname: str = "values"):
        self.argname = argname
        self.count = MetricState(jnp.array(0, dtype=jnp.int32))
        self.mean = MetricState(jnp.array(0, dtype=jnp.float32))
        self.m2 = MetricState(jnp.array(0, dtype=jnp.float32))

    def reset(self) -> None:
        self.count[...] = jnp.array(0, dtype=jnp.int32)
        self.mean[...] = jnp.array(0, dtype=jnp.float32)
        self.m2[...] = jnp.array(0, dtype=jnp.float32)

    @_mixed
    def update(self, **kwargs: Any) -> None:
        values = _argument(self, kwargs)
        scalar = isinstance(values, (int, float))
        count = 1 if scalar else values.size
        original_count = self.count[...]
        self.count[...] += count
        delta = (values if scalar else values.mean()) - self.mean[...]
        self.mean[...] += delta * count / self.count[...]
        m2 = 0.0 if scalar else values.var() * count
        self.m2[...] += m2 + delta * delta * count * original_count / self.count[...]

    @_mixed
    def compute(self) -> Statistics:
        variance = self.m2[...] / self.count[...]
        standard_deviation = variance ** 0.5
        sem = standard_deviation / (self.count[...] ** 0.5)
        return Statistics(mean=self.mean[...], standard_error_of_mean=sem,
                          standard_deviation=standard_deviation)


_METHODS = ("reset", "update", "compute", "split")


class MultiMetric(Metric):
    """Several metrics updated by one call: ``MultiMetric(loss=Average(),
    accuracy=Accuracy())``; each is an attribute, and ``update(**kw)`` gives every one all
    of ``kw``."""

    def __init__(self, **metrics: Metric):
        for name in metrics:
            if name in _METHODS:
                raise errors.ConfigError(
                    f"MultiMetric: a metric may not be named '{name}', which would hide the "
                    f"MultiMetric.{name} method.", path=(name,), **errors.where(),
                    fix="give the metric another name")
        self._metric_names = tuple(metrics)
        for name, metric in metrics.items():
            setattr(self, name, metric)

    def reset(self) -> None:
        for name in self._metric_names:
            getattr(self, name).reset()

    def update(self, **updates: Any) -> None:
        """Updates each metric with ``updates``; ``mask`` is given to each (a dict of masks
        by metric name: to each its own, none to a metric it does not name)."""
        mask = updates.pop("mask", None)
        for name in self._metric_names:
            own = mask.get(name) if isinstance(mask, dict) else mask
            getattr(self, name).update(**updates, **({} if own is None else {"mask": own}))

    def compute(self) -> dict[str, Any]:
        """``{name: metric.compute()}``."""
        return {name: getattr(self, name).compute() for name in self._metric_names}

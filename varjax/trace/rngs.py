"""``vj.Rngs``: named RNG streams as state, and ``vj.reseed``.

A stream is a key that never changes and a ``uint32`` count; drawing returns
``fold_in(key, count)`` and increments the count (Flax NNX's model: explicit,
order-based, dynamic counters).  ``vj.Rngs(0, params=1, dropout=key)`` holds
named streams plus a ``default`` one (the positional seed) that every unknown
name falls back to.

The same state is what a call keeps in collection ``rngs`` (``varjax.ir.streams``):
``init(vj.Rngs(...), x)`` returns the non-``params`` streams there, and
``apply(variables, x, mutable=['rngs'])`` draws fresh keys on every call.  An
``Rngs`` handed to ``init``/``apply``/``bind`` is drawn from and advanced, as
if the model had called it.

Every ``jax.random`` sampler is a method of each stream and of ``Rngs`` (which
uses ``default``): ``rngs.normal((2, 3))`` is ``jax.random.normal(rngs(), (2, 3))``.
The methods are made from ``jax.random``'s own functions, so they follow its
signatures and docs.

``Rngs`` is a pytree (leaves: each stream's key and count), so it goes through
``jax.jit`` and ``jax.vmap``; ``fork(split=n)`` gives an ``Rngs`` whose keys and
counts have a leading axis ``n``, one member per mapped example.

Sharp edges:
  * Under ``jax.jit``/``jax.vmap`` the ``Rngs`` a function receives is a copy:
    draws advance the copy.  Return it to keep its state, as with any pytree.
  * Advancing an ``Rngs`` from inside a transformation it was not passed into
    (a closure) would leak tracers; varjax raises ``TransformError`` instead.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Hashable, Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from varjax import _jax
from varjax.ir import errors, filters, streams
from varjax.ir.typing import ArrayLike, RngSeed, RngSplit, VariableDict
from varjax.trace import raw_writes

# jax.random functions taking a key first that manage keys instead of sampling.
_KEY_FUNCTIONS = frozenset({"clone", "fold_in", "split"})


def _is_typed(key: jax.Array) -> bool:
    return jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)


def _as_key(value: Any, stream: str) -> jax.Array:
    """A seed (int) becomes ``jax.random.key(seed)``; a key (typed or raw) stays."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return jax.random.key(value)
    dtype = getattr(value, "dtype", None)
    if dtype is not None and _is_typed(value):
        return value
    if dtype is not None and jnp.issubdtype(dtype, jnp.integer) and jnp.shape(value) == ():
        return jax.random.key(value)
    if dtype == jnp.uint32 and jnp.shape(value)[-1:] == (2,):
        return value   # a raw jax.random.PRNGKey
    raise errors.ConfigError(
        f"RNG stream '{stream}' needs an int seed or a key, got {type(value).__name__}"
        f"{'' if dtype is None else f' of dtype {dtype}'}.", collection=stream, **errors.where(),
        fix="pass an int (vj.Rngs(0, dropout=1)) or a key (jax.random.key(0))")


def _batch_shape(key: jax.Array) -> tuple[int, ...]:
    shape = jnp.shape(key)
    return shape if _is_typed(key) else shape[:-1]


def _like(old: jax.Array, key: jax.Array) -> jax.Array:
    """``key`` in the kind of ``old``: raw ``uint32`` data when the stream held a raw key,
    so that reseeding a stream never changes what kind of key it holds."""
    return jax.random.key_data(key) if not _is_typed(old) and _is_typed(key) else key


def _show(x: Any) -> str:
    """An array as ``type value``; a tracer as its type only; anything else (a leaf that
    ``jax.tree.map`` replaced) as its repr."""
    if not hasattr(x, "dtype"):
        return repr(x)
    if _jax.trace_of(x) is not None:
        return str(jax.typeof(x))
    data = jax.random.key_data(x) if _is_typed(x) else x
    return f"{jax.typeof(x).str_short()} {np.asarray(data).tolist()}"


def _chooses(f: Any, name: str, stream: "RngStream") -> bool:
    """Whether stream filter ``f`` chooses the stream ``name``: ``f`` a name, names, ``True``
    or ``...``, or a predicate ``(path, stream) -> bool`` as NNX's filters are (``nnx.Not``
    of a name), called with the path ``()`` as NNX calls it."""
    if f is Ellipsis:
        return True
    if callable(f) and not isinstance(f, type):
        return bool(f((), stream))
    return filters.matches(f, name)


class _Samplers:
    """Mixin: every ``jax.random`` sampler as a method drawing its key from ``self()``."""

    def __call__(self) -> jax.Array:
        raise NotImplementedError


def _sampler(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def method(self: _Samplers, *args: Any, **kwargs: Any) -> jax.Array:
        return fn(self(), *args, **kwargs)
    signature = inspect.signature(fn)
    method.__name__ = method.__qualname__ = name
    this = inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)
    method.__signature__ = signature.replace(
        parameters=[this, *list(signature.parameters.values())[1:]])
    method.__doc__ = (f"``jax.random.{name}`` with a fresh key from this stream (the "
                      f"``default`` stream on ``Rngs``).\n\n{fn.__doc__ or ''}")
    return method


def _install_samplers() -> None:
    for name, fn in inspect.getmembers(jax.random, inspect.isfunction):
        params = list(inspect.signature(fn).parameters)
        if not name.startswith("_") and name not in _KEY_FUNCTIONS and params[:1] == ["key"]:
            setattr(_Samplers, name, _sampler(name, fn))


_install_samplers()


@jax.tree_util.register_pytree_node_class
class RngStream(_Samplers):
    """One stream: ``stream()`` returns ``fold_in(key, count)`` and increments ``count``.

    A draw writes the count, so it is checked as a held Variable's write is
    (``raw_writes``): ``_made`` is the JAX trace the stream was made in, ``_source`` the
    original a copy JAX made of it under a transform stands for (None: no original, as
    for a stream varjax rebuilds itself, or one of an object-mode body)."""

    _made: Any = None
    _source: Any = None

    def __init__(self, key: RngSeed, count: ArrayLike | None = None, *, tag: str = streams.DEFAULT):
        self.tag = tag
        self.key = _as_key(key, tag)
        self.count = jnp.zeros(_batch_shape(self.key), jnp.uint32) if count is None else count
        self._made = _jax.trace_ref()

    def __call__(self) -> jax.Array:
        if raw_writes.pending:
            raw_writes.check_used(self)
        if self._made is not None and self._made is not _jax.trace_ref():
            raw_writes.check_write(self, self._made)
        elif self._source is not None:
            raw_writes.written(self, self._source)
        key = streams.derive(self.key, self.count)
        self.count = self.count + jnp.uint32(1)
        return key

    def fork(self, split: int | tuple[int, ...] | None = None) -> "RngStream":
        """A new stream keyed by a draw from this one; with ``split``, keys (and counts) with
        that leading shape, one stream per mapped member."""
        key = self()
        if split is not None:
            key = jax.random.split(key, split)
        return RngStream(key, tag=self.tag)

    def split(self, k: int | tuple[int, ...]) -> "RngStream":
        """A new stream whose keys are a draw from this one split to shape ``k`` (count 0 of
        that shape): one stream per member of a mapped axis, as NNX's ``RngStream.split``."""
        return RngStream(jax.random.split(self(), k), tag=self.tag)

    def broadcast(self, k: int | tuple[int, ...]) -> "RngStream":
        """A new stream whose keys are one draw from this one repeated to shape ``k``: every
        member of a mapped axis draws the same keys, as NNX's ``RngStream.broadcast``."""
        key = self()
        shape = (k,) if isinstance(k, int) else tuple(k)
        return RngStream(jnp.broadcast_to(key, shape + jnp.shape(key)), tag=self.tag)

    def _varjax_identity(self, field: str) -> Hashable:
        """The identity of this stream's ``field`` (``"key"``/``"count"``) as a variable of
        a transform's graph (``Variable._varjax_identity``): the stream's own field, unless
        the stream keeps it in another object."""
        return (id(self), field)

    def _varjax_replace(self, key: Any, count: Any = None) -> None:
        """Give this stream a new key (in its own kind) and count, in place: what
        ``nnx.reseed``/``split_rngs``/``fork_rngs``/``restore_rngs`` do to the streams inside
        an object, which keep being the same objects.  ``count`` None restarts at 0."""
        try:
            self.key = _like(self.key, key)
        except AttributeError:   # a stream inside an object-mode body: its key is fixed
            raise errors.TransformError(
                f"the key of RNG stream '{self.tag}' cannot be replaced inside an object-mode "
                "transformation (vj.jit, vj.vmap...): there, a stream's key is fixed.",
                collection=self.tag, **errors.where(),
                fix="reseed, split or fork the streams before the transformation") from None
        self.count = jnp.zeros(_batch_shape(self.key), jnp.uint32) if count is None else count

    def tree_flatten(self) -> tuple[tuple, tuple]:
        if raw_writes.pending:
            raw_writes.check_used(self)
        if self._source is not None:
            raw_writes.returned(self._source)
        return (self.key, self.count), (self.tag, raw_writes.Origin(self))

    @classmethod
    def tree_unflatten(cls, aux: tuple, children: tuple) -> "RngStream":
        stream = cls._varjax_rebuilt(aux[0], *children)
        stream._source = raw_writes.source_of(aux[1])
        return stream

    @classmethod
    def _varjax_rebuilt(cls, tag: str, key: Any, count: Any) -> "RngStream":
        """A stream holding ``key`` and ``count`` as they are (no key conversion), made
        here: what varjax rebuilds from a stream's two values."""
        stream = object.__new__(cls)
        stream.tag, stream.key, stream.count, stream._made = tag, key, count, _jax.trace_ref()
        return stream

    def __getstate__(self) -> dict[str, Any]:
        """Pickled as its tag, key and count (an NNX view of it is made again when asked
        for; the trace it was made in is not data)."""
        return {"tag": self.tag, "key": self.key, "count": self.count}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.tag, self.key, self.count = state["tag"], state["key"], state["count"]
        self._made = _jax.trace_ref()

    def __repr__(self) -> str:
        return f"RngStream(key={_show(self.key)}, count={_show(self.count)})"


@jax.tree_util.register_pytree_node_class
class Rngs(_Samplers):
    """Named RNG streams: ``vj.Rngs(0, params=1)`` has ``default`` (seed 0) and ``params``.

    ``rngs.params()`` / ``rngs['params']()`` draw from ``params``; ``rngs()`` and every
    unknown name (``rngs.dropout()``) draw from ``default``.  Pass it to ``init``/``apply``
    (as ``rngs``) to draw from it inside a model."""

    def __init__(self, default: RngSeed | RngStream | None = None, /,
                 **streams_: RngSeed | RngStream):
        if default is not None and streams.DEFAULT in streams_:
            raise errors.ConfigError(
                "the default stream was given twice: as the positional seed and as default=.",
                collection=streams.DEFAULT, **errors.where(),
                fix="pass the default seed once: vj.Rngs(0, ...) or vj.Rngs(default=0, ...)")
        found = {} if default is None else {streams.DEFAULT: default}
        found.update(streams_)
        self._streams = {name: value if isinstance(value, RngStream) else RngStream(value, tag=name)
                         for name, value in sorted(found.items())}

    # -- streams --------------------------------------------------------------------
    def __getitem__(self, name: str) -> RngStream:
        stream = self._streams.get(name, self._streams.get(streams.DEFAULT))
        if stream is None:
            raise errors.UnknownStreamError(
                f"this Rngs has no stream '{name}' and no default stream to fall back to "
                f"(it has: {', '.join(self._streams) or 'none'}).", collection=name,
                **errors.where(), fix=f"add it: vj.Rngs(..., {name}=seed), or give a default "
                                      "seed: vj.Rngs(0, ...)")
        return stream

    def __getattr__(self, name: str) -> RngStream:
        if name.startswith("_"):
            raise AttributeError(name)
        return self[name]

    def __contains__(self, name: object) -> bool:
        return name in self._streams

    def __iter__(self) -> Iterator[str]:
        return iter(self._streams)

    def __call__(self) -> jax.Array:
        return self[streams.DEFAULT]()

    def fork(self, split: RngSplit | None = None) -> "Rngs":
        """A new ``Rngs`` whose every stream is keyed by a draw from this one (which advances).

        ``split=n`` (or a shape) gives keys and counts a leading axis ``n``, to pass through
        ``jax.vmap``; a dict ``{stream filter: n or None}`` splits only matching streams
        (first match wins, unmatched streams are forked without a split)."""
        def split_of(name: str) -> Any:
            if not isinstance(split, Mapping):
                return split
            return next((n for f, n in split.items() if _chooses(f, name, self[name])), None)
        forked = object.__new__(Rngs)
        forked._streams = {name: s.fork(split_of(name)) for name, s in self._streams.items()}
        return forked

    def split(self, k: RngSplit) -> "Rngs":
        """A new ``Rngs`` whose streams are this one's split (``RngStream.split``) to ``k``
        (a shape), or with ``{stream filter: shape or None}`` the streams the first matching
        filter gives a shape.  The other streams restart from their keys at count 0: NNX
        makes the new ``Rngs`` from each stream's key."""
        return self._each("split", k)

    def broadcast(self, k: RngSplit) -> "Rngs":
        """As ``split``, each chosen stream broadcast (``RngStream.broadcast``) to ``k``."""
        return self._each("broadcast", k)

    def _each(self, method: str, k: Any) -> "Rngs":
        rules = k if isinstance(k, Mapping) else {True: k}
        new = object.__new__(Rngs)
        new._streams = {}
        for name, stream in self._streams.items():
            shape = next((n for f, n in rules.items() if _chooses(f, name, stream)), None)
            new._streams[name] = (RngStream(stream.key, tag=name) if shape is None
                                  else getattr(stream, method)(shape))
        return new

    # -- pytree ---------------------------------------------------------------------
    def tree_flatten(self) -> tuple[tuple, tuple]:
        return tuple(self._streams.values()), tuple(self._streams)

    @classmethod
    def tree_unflatten(cls, names: tuple, children: tuple) -> "Rngs":
        rngs = object.__new__(cls)
        rngs._streams = dict(zip(names, children))
        return rngs

    def __repr__(self) -> str:
        inner = "".join(f"\n  {name}={stream!r}," for name, stream in self._streams.items())
        return f"Rngs({inner}\n)" if inner else "Rngs()"

    # -- what functionalize uses: a call's RNG state in, the counts it left out ---------
    def _varjax_rng_state(self) -> dict[str, tuple[Any, Any]]:
        if raw_writes.pending:
            for stream in self._streams.values():
                raw_writes.check_used(stream)
        return {name: (s.key, s.count) for name, s in self._streams.items()}

    def _varjax_advance(self, counts: Mapping[str, Any]) -> None:
        """Take the counts a call left its streams at; refused when the call ran inside a
        transformation this ``Rngs`` was not passed into (its tracers would escape)."""
        for name, count in counts.items():
            stream = self._streams[name]
            own = _jax.trace_of(stream.count)
            if (own is None and not _jax.is_top_level()) or (own is not None and
                                                             own is not _jax.current_trace()):
                raise errors.TransformError(
                    f"RNG stream '{name}' of a vj.Rngs was drawn from inside a JAX "
                    "transformation it was not passed into, so its count cannot advance.",
                    collection=name, **errors.where(),
                    fix="pass the Rngs into the transformed function as an argument (and "
                        "return it), or pass a key instead: rngs={'" + name + "': key}")
            if stream._source is not None:     # a copy a raw JAX transform made: return it
                raw_writes.written(stream, stream._source)
            stream.count = count


def reseed(target: VariableDict | Rngs, **seeds: RngSeed) -> VariableDict | Rngs:
    """A copy of ``target`` (a variables dict with an ``rngs`` collection, or an ``Rngs``)
    whose named streams restart: new key from the seed or key, count 0.  A forked stream
    (keys with a leading axis) gets the new key split to the same shape.

    ``vj.reseed(variables, dropout=1)`` makes the next call draw what a fresh
    ``vj.Rngs(dropout=1)`` would."""
    if isinstance(target, Rngs):
        state = {name: {"key": s.key, "count": s.count} for name, s in target._streams.items()}
    elif isinstance(target, Mapping):
        state = dict(target.get(streams.STATE, {}))
    else:
        raise TypeError(f"vj.reseed needs a variables dict or a vj.Rngs, got {type(target).__name__}")
    for name, seed in seeds.items():
        if name not in state:
            raise errors.UnknownStreamError(
                f"vj.reseed: there is no RNG stream '{name}' to reseed (the state has: "
                f"{', '.join(state) or 'none'}).", collection=streams.STATE, path=(name,),
                **errors.where(), fix="reseed one of those streams, or create the stream by "
                                      "passing a vj.Rngs with it to init")
        old = state[name]["key"]
        shape = _batch_shape(old)
        key = _as_key(seed, name)
        key = _like(old, jax.random.split(key, shape) if shape else key)
        state[name] = {"key": key, "count": jnp.zeros(shape, jnp.uint32)}
    if isinstance(target, Rngs):
        return Rngs(**{name: RngStream(s["key"], s["count"], tag=name) for name, s in state.items()})
    return {**target, streams.STATE: state}

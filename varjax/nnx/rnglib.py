"""NNX's randomness functions over objects: ``split_rngs``, ``fork_rngs``, ``with_rngs``,
``backup_keys``, ``restore_rngs``, ``reseed``.

``nnx.Rngs``/``nnx.RngStream`` are ``vj.Rngs``/``vj.RngStream`` (``varjax.trace.rngs``), and
an NNX object is a pytree holding them, so these functions walk the object with the walk
every NNX function shares (``pytree.children``) and act on each ``RngStream`` they meet, as
flax.nnx 0.12.8 does, bit for bit: the same draws from each stream, in the same order.

Two ways, as NNX's ``graph=``/``graph_updates=`` choose (both on by default, as in Flax):

* graph updates (``graph=True, graph_updates=True``): the streams inside ``node`` are changed
  in place (each keeps being the same object) and the old key and count of each come back
  as ``SplitBackups``, for ``restore_rngs`` or a ``with`` block to put back;
* otherwise a copy of ``node`` comes back whose chosen streams are new (the originals are
  drawn from once each, as NNX's copy shares their counts); its other streams and its
  Variables are the originals' objects.  ``with_rngs`` has only this form.

Graph mode visits a stream reachable twice once; tree mode (``graph=False``) refuses one, as
NNX refuses shared references there.  A stream is chosen by a filter (``only=``, the keys of
``split=``) that must match both its key and its count, seen as ``nnx.RngKey``/
``nnx.RngCount`` Variables tagged with the stream's name at ``(*path, 'key')`` and
``(*path, 'count')``: ``'dropout'`` chooses the ``dropout`` streams, ``nnx.RngState`` all.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence, TypeVar

import jax

from varjax.ir import errors
from varjax.ir.typing import Filter, Node, PRNGKey
from varjax.nnx.config import resolve
from varjax.nnx.filterlib import to_predicate
from varjax.nnx.pytree import flatten_node, in_order, is_node
from varjax.nnx.rng_variables import stream_variables
from varjax.trace.rngs import Rngs, RngStream
from varjax.trace.variable import Variable

__all__ = ["split_rngs", "fork_rngs", "with_rngs", "backup_keys", "restore_rngs", "reseed",
           "SplitBackups"]

F = TypeVar("F", bound=Callable[..., Any])
Path = tuple
Splits = int | tuple[int, ...]
"""How many keys a stream is split to: a count, or a shape."""
Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]
"""What each function here returns when called without a node: it wraps a function so that
the function's arguments get the change for the call."""


class _Missing:
    """No node given: the call is a decorator factory."""


_MISSING = _Missing()


# -- walking an object --------------------------------------------------------------------

def _walk(node: Any, graph: bool, on_stream: Callable[[Path, RngStream], Any]) -> Any:
    """``node`` rebuilt with each stream replaced by ``on_stream(path, stream)``, visiting
    streams in NNX's order (depth first, children in ``pytree.children``'s order: the walk
    every NNX function shares).  Graph mode visits an object reachable twice once (both
    places get the one result); tree mode refuses it."""
    done: dict[int, Any] = {}
    seen: dict[int, Path] = {}

    def visit(path: Path, x: Any) -> Any:
        if graph and id(x) in done:
            return done[id(x)]
        if not graph and isinstance(x, (RngStream, Variable)):
            if id(x) in seen:
                raise errors.InconsistentAliasError(
                    f"{type(x).__name__} found at two paths, {_show(seen[id(x)])} and "
                    f"{_show(path)}: tree mode (graph=False) does not take shared "
                    "references.", path=tuple(map(str, path)), **errors.where(),
                    fix="pass graph=True, or give each place its own object")
            seen[id(x)] = path
        if isinstance(x, RngStream):
            out = on_stream(path, x)
        elif isinstance(x, Variable) or not is_node(x):
            out = x
        else:
            pairs, treedef = flatten_node(x)
            new = {k: visit((*path, k), child) for k, child in in_order(pairs)}
            out = treedef.unflatten([new[k] for k, _ in pairs])
        done[id(x)] = out
        return out

    return visit((), node)


def _streams(node: Any, graph: bool) -> list[tuple[Path, RngStream]]:
    """Every stream inside ``node`` with its path, in NNX's order."""
    found: list[tuple[Path, RngStream]] = []
    _walk(node, graph, lambda path, s: found.append((path, s)))
    return found


def _show(path: Path) -> str:
    return "/".join(map(str, path)) or "(the node itself)"


def _chosen(predicate: Callable[[Path, Any], bool], path: Path, stream: RngStream) -> bool:
    """Whether a filter chooses ``stream``: it matches the stream's key and its count, each
    seen as NNX shows it (an ``RngKey``/``RngCount`` tagged with the stream's name)."""
    views = stream_variables(stream)
    return (predicate((*path, "key"), views["key"])
            and predicate((*path, "count"), views["count"]))


# -- backups ------------------------------------------------------------------------------

@jax.tree_util.register_pytree_node_class
class SplitBackups(Iterable):
    """The old key and count of each stream ``split_rngs``/``fork_rngs`` changed in place,
    as ``(stream, key, count)``; ``restore_rngs`` puts them back, as does leaving a ``with``
    block over it."""

    def __init__(self, backups: list):
        self.backups = backups

    def __iter__(self) -> Iterator[tuple]:
        return iter(self.backups)

    def __enter__(self) -> SplitBackups:
        return self

    def __exit__(self, *exc: Any) -> None:
        restore_rngs(self)

    def tree_flatten(self) -> tuple[tuple, None]:
        return (self.backups,), None

    @classmethod
    def tree_unflatten(cls, aux: None, children: tuple) -> SplitBackups:
        return cls(*children)


def restore_rngs(backups: Iterable[tuple], /) -> None:
    """Put back each stream's backed-up key (and count, when the backup has one)."""
    for stream, key, *count in backups:
        stream._varjax_replace(key, count[0] if count else stream.count)


# -- split_rngs -----------------------------------------------------------------------------

def split_rngs(node: Node = _MISSING, /, *, splits: Splits, only: Filter = ...,
               squeeze: bool = False, graph: bool | None = None,
               graph_updates: bool | None = None) -> SplitBackups | Node | Decorator:
    """Each chosen stream (``only``) draws a key and is keyed by that key split to ``splits``
    (count 0 of that shape): one stream per member of a mapped axis.  ``squeeze=True`` (with
    ``splits=1``) keeps the first key and no new axis.

    In place with backups (graph updates), or a copy (module docstring); with no ``node``,
    a decorator doing it to a function's arguments for the call (in place: restored after)."""
    graph, graph_updates = resolve(graph, graph_updates)
    if isinstance(node, _Missing):
        return _decorator(split_rngs, graph, graph_updates,
                          dict(splits=splits, only=only, squeeze=squeeze))
    if squeeze and splits != 1:
        raise errors.ConfigError(
            f"split_rngs: squeeze=True needs splits=1, got splits={splits!r}.", **errors.where(),
            fix="pass splits=1 with squeeze=True, or squeeze=False")
    predicate = to_predicate(only)

    def split_key(stream: RngStream) -> Any:
        key = jax.random.split(stream(), splits)
        return key[0] if squeeze else key

    if graph and graph_updates:
        backups = []
        for path, stream in _streams(node, graph=True):
            if _chosen(predicate, path, stream):
                key = split_key(stream)
                backups.append((stream, stream.key, stream.count))
                stream._varjax_replace(key)
        return SplitBackups(backups)
    return _walk(node, graph, lambda path, s: RngStream(split_key(s), tag=s.tag)
                 if _chosen(predicate, path, s) else s)


# -- fork_rngs ------------------------------------------------------------------------------

def fork_rngs(node: Node = _MISSING, /, *,
              split: Splits | Mapping[Filter, Splits | None] | None = None,
              graph: bool | None = None,
              graph_updates: bool | None = None) -> SplitBackups | Node | Decorator:
    """Each stream is keyed by a draw from itself (count 0): ``stream.fork(split=n)``, ``n``
    from ``split`` (None, a shape, or ``{filter: shape or None}``; a stream no filter
    matches is left alone).

    In place with backups (graph updates), or a copy (module docstring); with no ``node``,
    a decorator doing it to a function's arguments for the call (in place: restored after).
    In place, a stream matching several filters is forked once per match, as in NNX."""
    graph, graph_updates = resolve(graph, graph_updates)
    if isinstance(node, _Missing):
        return _decorator(fork_rngs, graph, graph_updates, dict(split=split))
    if split is None:
        split = {...: None}
    elif not isinstance(split, Mapping):
        split = {...: split}
    predicates = {to_predicate(f): n for f, n in split.items()}

    if graph and graph_updates:
        backups = []
        for path, stream in _streams(node, graph=True):
            for predicate, n in predicates.items():
                if _chosen(predicate, path, stream):
                    forked = stream.fork(n)
                    backups.append((stream, stream.key, stream.count))
                    stream._varjax_replace(forked.key, forked.count)
        return SplitBackups(backups)

    def fork_one(path: Path, stream: RngStream) -> RngStream:
        n = next(((n,) for p, n in predicates.items() if _chosen(p, path, stream)), None)
        return stream if n is None else stream.fork(n[0])
    return _walk(node, graph, fork_one)


def _decorator(fn: Callable[..., Any], graph: bool, graph_updates: bool,
               options: dict[str, Any]) -> Callable[[F], F]:
    """``fn`` (split_rngs or fork_rngs) as a decorator over a function's ``(args, kwargs)``:
    in place for the call and restored after (graph updates), or the call gets copies."""
    def decorate(f: F) -> F:
        @functools.wraps(f)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if graph and graph_updates:
                with fn((args, kwargs), graph=True, graph_updates=True, **options):
                    return f(*args, **kwargs)
            args, kwargs = fn((args, kwargs), graph=graph, graph_updates=False, **options)
            return f(*args, **kwargs)
        return wrapper  # type: ignore[return-value]
    return decorate


# -- with_rngs -----------------------------------------------------------------------------

def _rules(rule: Any) -> list[tuple[Any, Callable[[Path, Any], bool], Any]]:
    """``split=``/``broadcast=`` as ``(filter, predicate, shape)`` rules: a shape alone is
    ``{...: shape}``."""
    if rule is None:
        return []
    rule = rule if isinstance(rule, Mapping) else {...: rule}
    return [(f, to_predicate(f), n) for f, n in rule.items()]


def with_rngs(node: Node = _MISSING, /, *, split: Splits | Mapping[Filter, Splits] | None = None,
              fork: Filter | Sequence[Filter] | None = None,
              broadcast: Splits | Mapping[Filter, Splits] | None = None, only: Filter = True,
              graph: bool | None = None,
              graph_updates: bool | None = None) -> Node | Decorator:
    """A copy of ``node`` whose chosen streams are new: split (``RngStream.split``) or
    broadcast (``RngStream.broadcast``) to a shape, or forked (``RngStream.fork``), by the
    first filter of each rule that matches the stream (a string matches a stream's tag:
    ``split={'params': 4}``).  ``split``/``broadcast`` take a shape or ``{filter: shape}``,
    ``fork`` a filter or a sequence of them, ``only`` limits all three.  A stream matched by
    two rules through two filters other than ``...``/``True`` is ambiguous, an error; else
    split wins over broadcast, broadcast over fork.  Other streams and the Variables are the
    originals' (module docstring).

    As in flax.nnx 0.12.8 there is no in-place form: graph mode needs ``graph_updates=False``.
    With no ``node``, a decorator giving a function's arguments as such a copy."""
    graph, graph_updates = resolve(graph, graph_updates)
    if graph and graph_updates:
        raise errors.NotProvidedError(
            "with_rngs with graph=True and graph_updates=True: it returns a copy, and has no "
            "in-place form (nor has flax.nnx's).", **errors.where(),
            fix="pass graph_updates=False (or graph=False); for in-place splits and forks, "
                "use split_rngs/fork_rngs")
    if isinstance(node, _Missing):
        def decorate(f: F) -> F:
            @functools.wraps(f)
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                args, kwargs = with_rngs((args, kwargs), split=split, fork=fork,
                                         broadcast=broadcast, only=only, graph=graph,
                                         graph_updates=False)
                return f(*args, **kwargs)
            return wrapper  # type: ignore[return-value]
        return decorate
    forks = [] if fork is None else [fork] if isinstance(fork, str) or not isinstance(
        fork, (list, tuple)) else list(fork)
    tables = {"split": _rules(split), "broadcast": _rules(broadcast),
              "fork": [(f, to_predicate(f), None) for f in forks]}
    chosen = to_predicate(only)

    def update(path: Path, stream: RngStream) -> RngStream:
        if not chosen(path, stream):
            return stream
        found = {how: next(((f, n) for f, p, n in rules if p(path, stream)), None)
                 for how, rules in tables.items()}
        found = {how: match for how, match in found.items() if match is not None}
        specific = [how for how, (f, _) in found.items() if f is not Ellipsis and f is not True]
        if len(found) > 1 and len(specific) > 1:
            raise errors.ConfigError(
                f"with_rngs: the stream at {_show(path)} matches several rules: " + ", ".join(
                    f"{how} by filter {f!r}" for how, (f, _) in found.items()) + ".",
                path=tuple(map(str, path)), **errors.where(),
                fix="make the filters of split=, broadcast= and fork= choose different streams")
        if "split" in found:
            return stream.split(found["split"][1])
        if "broadcast" in found:
            return stream.broadcast(found["broadcast"][1])
        return stream.fork() if "fork" in found else stream
    return _walk(node, graph, update)


def backup_keys(node: Node, /, *, graph: bool | None = None
                ) -> list[tuple[RngStream, PRNGKey]]:
    """``(stream, key)`` for every stream inside ``node``, in NNX's order: what
    ``restore_rngs`` takes to put the keys back (the counts stay as they are then)."""
    return [(stream, stream.key) for _, stream in _streams(node, resolve(graph)[0])]


# -- reseed ---------------------------------------------------------------------------------

def _scalars_only(path: Path, key: Any, shape: tuple[int, ...]) -> Any:
    if shape != ():
        raise errors.ConfigError(
            f"reseed: the stream at {_show(path)} has keys of shape {shape}, not one key, and "
            "policy='scalars_only' reseeds single keys only.", path=tuple(map(str, path)),
            **errors.where(), fix="pass policy='match_shape' (the new key split to that "
                                  "shape), or a policy (path, key, shape) -> keys")
    return key


def _match_shape(path: Path, key: Any, shape: tuple[int, ...]) -> Any:
    return jax.random.split(key, shape) if shape else key


_POLICIES = {"scalars_only": _scalars_only, "match_shape": _match_shape}


def reseed(node: Node, /, *, graph: bool | None = None,
           policy: str | Callable[[Path, PRNGKey, tuple[int, ...]], PRNGKey] = "scalars_only",
           **stream_keys: Any) -> None:
    """Restart, in place, every stream inside ``node`` whose name is one of ``stream_keys``:
    its key becomes the next draw of ``vj.Rngs(**stream_keys)``'s stream of that name
    (``fold_in(key(seed), i)`` for the ``i``-th such stream met, as NNX draws it), made
    into the stream's key shape by ``policy``; its count becomes 0.

    NNX's in-place form, for models; ``vj.reseed`` is the copying form for a variables dict
    or an ``Rngs`` (and keys a fresh stream by the seed itself)."""
    if callable(policy):
        make = policy
    elif policy in _POLICIES:
        make = _POLICIES[policy]
    else:
        raise errors.ConfigError(
            f"reseed: policy must be 'scalars_only', 'match_shape' or a callable, got "
            f"{policy!r}.", **errors.where(), fix="pass policy='match_shape'")
    seeds = Rngs(**stream_keys)
    for path, stream in _streams(node, resolve(graph)[0]):
        if stream.tag in stream_keys:
            stream._varjax_replace(make(path, seeds[stream.tag](), jax.numpy.shape(stream.count)))

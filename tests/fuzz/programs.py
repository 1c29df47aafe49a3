"""Random effectful programs for the varjax fuzz test.

A *program* is a tiny AST of variable reads, writes, RNG draws and ``sow``s,
nested in raw JAX higher-order primitives (``jax.jit``, ``lax.scan``,
``lax.while_loop``, ``lax.cond``, ``lax.switch``, ``jax.checkpoint``,
``jax.custom_jvp``, ``jax.custom_vjp``).  It is run two ways:

* ``build_varjax_fn(program)`` turns it into an ordinary Python function over
  ``vj.*`` and ``jax.lax.*``, to be wrapped in ``vj.functionalize``;
* ``reference_run(program, variables, args, rng_keys, mutable)`` executes it
  eagerly, op by op, with a plain ``dict`` as the variable store and the RNG
  counters kept in Python.

Both must give the same output and the same updated variables.

Every program is a function ``f(x, sel)``: ``x`` is a float32 array of the
program's shape (``()`` or ``(2,)``), ``sel`` an int32 scalar in ``[0, 4]``.
Statements thread one float32 accumulator ``h`` (initially ``x``) and return
the final ``h``.  The arithmetic lives in small helpers shared by both
executors (``_mix_read``, ``_write_value``, ``_mix_draw``…) so the two compute
the same formulas; only XLA fusion may change the last bits.

Rules the generator follows (programs varjax rejects by design are never
generated):

* variables are created ("declared") only in straight-line code: at top
  level, or inside jit / checkpoint / custom_jvp / custom_vjp bodies that are
  not inside a loop or a cond; ``vj.param`` only at top level.  Reads and
  writes only touch variables declared earlier in program order;
* ``sow`` with the default tuple reduction (which changes the variable's
  structure) only in straight-line code; inside loops and conds only the
  additive ``sow`` on a name that straight-line code already sowed;
* a while loop's ``cond_fun`` only reads.

RNG semantics the reference implements for explicit keys (Linen's convention,
``notes/randomness.md``; every draw is at the root path): each draw *statement*
gets a count ``c`` in trace order -- every statement once, loop bodies once,
all branches of a cond / switch in order (lax.cond traces the true branch
first) -- and returns ``fold_in(key, h(c))``, ``h = varjax.ir.streams.linen_data``.
Inside a loop whose body draws from the stream, the loop keeps a dynamic count
``i``: the i-th draw executed inside the loop (over all iterations) returns
``fold_in(fold_in(L, h(c)), i)``, with ``L`` the stream key; a nested drawing
loop's ``L`` is ``fold_in(L_outer, i_outer)``, one dynamic draw of the outer loop
each time it starts.  Streams kept as state follow NNX's convention: every
draw is dynamic, ``fold_in(key, count)``.
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Union

import jax
import jax.extend.random
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

from varjax.ir import streams

COLLECTIONS = ("params", "state", "stats")
STREAMS = ("params", "dropout")
F32 = jnp.float32
MAX_DEPTH = 3


# --- the AST -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Param:
    """``w = vj.param(name, _param_init, shape)``; ``h = h * 0.5 + w``.  Top level only."""
    name: str


@dataclass(frozen=True)
class Declare:
    """``vj.variable(col, name, lambda: full(shape, init))``.  Straight-line only."""
    col: str
    name: str
    init: float


@dataclass(frozen=True)
class Read:
    """``h = _mix_read(h, vj.variable(col, name).value, op)``."""
    col: str
    name: str
    op: int


@dataclass(frozen=True)
class Write:
    """``v.value = _write_value(h, v.value, op)`` (op 0 does not read the old value)."""
    col: str
    name: str
    op: int


@dataclass(frozen=True)
class Draw:
    """``h = _mix_draw(h, vj.make_rng(stream), op)``."""
    stream: str
    op: int


@dataclass(frozen=True)
class Sow:
    """``vj.sow(col, name, h)``; ``add`` uses ``reduce_fn=a + b, init_fn=zeros``.

    The returned bool is folded into ``h`` (``+0.01`` / ``-0.01``)."""
    col: str
    name: str
    add: bool


@dataclass(frozen=True)
class Jit:
    body: tuple


@dataclass(frozen=True)
class Checkpoint:
    body: tuple


@dataclass(frozen=True)
class CustomJvp:
    body: tuple


@dataclass(frozen=True)
class CustomVjp:
    body: tuple


@dataclass(frozen=True)
class Scan:
    """``lax.scan`` over ``xs = arange(length)``; body sees ``h + 0.01 * x``; ``ys = h * 0.5``;
    afterwards ``h = carry + 0.1 * sum(ys)``."""
    body: tuple
    length: int


@dataclass(frozen=True)
class While:
    """``lax.while_loop`` with an ``(i, h)`` carry; ``n`` iterations (``None``: ``sel % 3``).
    ``cond_fun`` also reads ``cond_reads`` (always true for bounded values)."""
    body: tuple
    n: int | None
    cond_reads: tuple = ()


@dataclass(frozen=True)
class Cond:
    """``lax.cond``; ``pred`` is ``'h'`` (``sum(h) > 0``) or ``'sel'`` (``sel % 2 == 0``)."""
    pred: str
    true: tuple
    false: tuple


@dataclass(frozen=True)
class Switch:
    """``lax.switch``; ``index`` is ``'h'`` (``[sum(h) > 0] + [sum(h) > 1]``) or ``'sel'``
    (``sel`` itself, clamped by ``lax.switch``)."""
    index: str
    branches: tuple


Stmt = Union[Param, Declare, Read, Write, Draw, Sow, Jit, Checkpoint, CustomJvp, CustomVjp,
             Scan, While, Cond, Switch]
WRAPPERS = (Jit, Checkpoint, CustomJvp, CustomVjp)
LOOPS = (Scan, While)


@dataclass(frozen=True)
class Program:
    body: tuple
    shape: tuple

    def __str__(self) -> str:
        return format_program(self)


def children(stmt: Stmt) -> list[tuple]:
    """The statement blocks nested directly in ``stmt``."""
    if isinstance(stmt, WRAPPERS + LOOPS):
        return [stmt.body]
    if isinstance(stmt, Cond):
        return [stmt.true, stmt.false]
    if isinstance(stmt, Switch):
        return list(stmt.branches)
    return []


def walk(stmts: tuple):
    for s in stmts:
        yield s
        for block in children(s):
            yield from walk(block)


def written_collections(program: Program) -> set[str]:
    """Collections a Write touches: these must be mutable in apply (sow is a no-op otherwise)."""
    return {s.col for s in walk(program.body) if isinstance(s, Write)}


def drawn_streams(stmts: tuple) -> set[str]:
    """Streams drawn from anywhere in ``stmts`` (statically: untaken branches included)."""
    out = set()
    for s in walk(stmts):
        if isinstance(s, Draw):
            out.add(s.stream)
        elif isinstance(s, Param):
            out.add("params")
    return out


def format_program(program: Program) -> str:
    lines = [f"Program(shape={program.shape})"]

    def fmt(stmts, indent):
        for s in stmts:
            pad = "  " * indent
            if isinstance(s, (Cond, Switch)):
                head = f"Cond(pred={s.pred!r})" if isinstance(s, Cond) else f"Switch(index={s.index!r})"
                lines.append(pad + head)
                for i, b in enumerate(children(s)):
                    lines.append(pad + f"  branch {i}:")
                    fmt(b, indent + 2)
            elif isinstance(s, WRAPPERS + LOOPS):
                fields = {f.name: getattr(s, f.name) for f in dataclasses.fields(s) if f.name != "body"}
                args = ", ".join(f"{k}={v!r}" for k, v in fields.items())
                lines.append(pad + f"{type(s).__name__}({args})")
                fmt(s.body, indent + 1)
            else:
                lines.append(pad + repr(s))
    fmt(program.body, 1)
    return "\n".join(lines)


# --- a PRNG that is cheap to compile --------------------------------------------------------
# XLA takes ~0.1 s per threefry hash to compile on CPU, and every draw in a functionalized
# program is a fold_in (plus the hash inside uniform), so most examples use this
# multiply-xorshift generator (varjax must not care which implementation a typed key has);
# the strategy still picks threefry for a share of the examples.

_U32 = jnp.uint32


def _hash(x):
    x = x ^ (x >> 16)
    x = x * _U32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * _U32(0x846CA68B)
    return x ^ (x >> 16)


def _cheap_seed(seed):
    s = jnp.asarray(seed).astype(_U32)
    return jnp.stack([_hash(s ^ _U32(0x9E3779B9)), _hash(s + _U32(0x632BE59B))])


def _cheap_fold_in(key, data):
    d = jnp.asarray(data).astype(_U32)
    return jnp.stack([_hash(key[0] ^ _hash(d + _U32(0x85EBCA6B))), _hash(key[1] + _hash(d ^ key[0]))])


def _cheap_bits(key, bit_width, shape):
    if bit_width != 32:
        raise NotImplementedError(f"fuzz PRNG: {bit_width}-bit draws")
    c = jnp.arange(int(np.prod(shape, dtype=int)), dtype=_U32)
    return _hash(_hash(c ^ key[0]) + key[1]).reshape(shape)


def _cheap_split(key, shape):
    n = int(np.prod(shape, dtype=int))
    ks = jax.vmap(lambda i: _cheap_fold_in(key, i))(jnp.arange(n, dtype=_U32) + _U32(0x5BD1E995))
    return ks.reshape(tuple(shape) + (2,))


CHEAP_PRNG = jax.extend.random.define_prng_impl(
    key_shape=(2,), seed=_cheap_seed, split=_cheap_split, random_bits=_cheap_bits,
    fold_in=_cheap_fold_in, name="varjax_fuzz_cheap")
PRNG_IMPLS = {"cheap": CHEAP_PRNG, "threefry": "threefry2x32"}


# --- shared arithmetic ---------------------------------------------------------------------

def _param_init(key, shape):
    return jax.random.uniform(key, shape, F32, -1.0, 1.0)


def _declare_init(shape, init):
    return lambda: jnp.full(shape, init, F32)


def _zeros_init(shape):
    return lambda: jnp.zeros(shape, F32)


def _mix_read(h, v, op):
    if op == 0:
        return h * 0.5 + v
    if op == 1:
        return jnp.tanh(h + v)
    return h * jnp.cos(v)


def _write_value(h, old, op):
    if op == 0:
        return jnp.tanh(h)
    if op == 1:
        return jnp.sin(h + 0.5 * old) * 0.9
    return old * 0.5 + h * 0.25


def _mix_draw(h, key, op):
    shape = jnp.shape(h)
    if op == 0:
        return h + (jax.random.uniform(key, shape, F32) - 0.5) * 0.5
    if op == 1:
        return h * (0.75 + 0.25 * jax.random.uniform(key, shape, F32))
    bits = jax.random.key_data(key)[-1] >> 8           # the key's own bits, compared exactly
    return h + (bits.astype(F32) * (2.0 ** -24) - 0.5) * 0.25


def _mix_sow(h, ok):
    return h + (0.01 if ok else -0.01)


def _add(a, b):
    return a + b


def _scan_in(h, x):
    return h + 0.01 * x


def _scan_out(h, ys):
    return h + 0.1 * jnp.sum(ys, axis=0)


def _cond_pred(kind, h, sel):
    return jnp.sum(h) > 0 if kind == "h" else sel % 2 == 0


def _switch_index(kind, h, sel):
    if kind == "h":
        s = jnp.sum(h)
        return (s > 0).astype(jnp.int32) + (s > 1).astype(jnp.int32)
    return sel


def _while_bound(n, sel):
    return sel % 3 if n is None else n


def _while_read_ok(v):
    return jnp.all(v > -100.0)


# --- executor 1: a varjax function -----------------------------------------------------------

def build_varjax_fn(program: Program) -> Callable:
    """A function ``f(x, sel) -> h`` over ``vj.*`` and raw JAX control flow."""
    import varjax as vj

    shape = program.shape

    def handle(col, name):
        return vj.variable(col, name, _zeros_init(shape))

    def run(stmts, h, sel):
        for s in stmts:
            h = step(s, h, sel)
        return h

    def body_fn(stmts):
        return lambda h, sel: run(stmts, h, sel)

    def step(s, h, sel):
        if isinstance(s, Param):
            return _mix_read(h, vj.param(s.name, _param_init, shape), 0)
        if isinstance(s, Declare):
            vj.variable(s.col, s.name, _declare_init(shape, s.init))
            return h
        if isinstance(s, Read):
            return _mix_read(h, handle(s.col, s.name).value, s.op)
        if isinstance(s, Write):
            v = handle(s.col, s.name)
            old = v.value if s.op else None
            v.value = _write_value(h, old, s.op)
            return h
        if isinstance(s, Draw):
            return _mix_draw(h, vj.make_rng(s.stream), s.op)
        if isinstance(s, Sow):
            if s.add:
                ok = vj.sow(s.col, s.name, h, reduce_fn=_add, init_fn=_zeros_init(shape))
            else:
                ok = vj.sow(s.col, s.name, h)
            return _mix_sow(h, ok)
        if isinstance(s, Jit):
            return jax.jit(body_fn(s.body))(h, sel)
        if isinstance(s, Checkpoint):
            return jax.checkpoint(body_fn(s.body))(h, sel)
        if isinstance(s, CustomJvp):
            f = jax.custom_jvp(body_fn(s.body))

            def jvp(primals, tangents, body=s.body):
                return run(body, *primals), tangents[0]
            f.defjvp(jvp)
            return f(h, sel)
        if isinstance(s, CustomVjp):
            f = jax.custom_vjp(body_fn(s.body))
            f.defvjp(lambda h, sel, body=s.body: (run(body, h, sel), None),
                     lambda res, g: (g, None))
            return f(h, sel)
        if isinstance(s, Scan):
            def scan_body(carry, x, body=s.body):
                hh = run(body, _scan_in(carry, x), sel)
                return hh, hh * 0.5
            carry, ys = jax.lax.scan(scan_body, h, jnp.arange(s.length, dtype=F32))
            return _scan_out(carry, ys)
        if isinstance(s, While):
            def cond_fun(c, s=s):
                ok = c[0] < _while_bound(s.n, sel)
                for col, name in s.cond_reads:
                    ok = ok & _while_read_ok(handle(col, name).value)
                return ok

            def body_fun(c, body=s.body):
                return c[0] + 1, run(body, c[1], sel)
            return jax.lax.while_loop(cond_fun, body_fun, (jnp.int32(0), h))[1]
        if isinstance(s, Cond):
            return jax.lax.cond(_cond_pred(s.pred, h, sel), body_fn(s.true), body_fn(s.false),
                                h, sel)
        if isinstance(s, Switch):
            return jax.lax.switch(_switch_index(s.index, h, sel),
                                  [body_fn(b) for b in s.branches], h, sel)
        raise TypeError(s)

    def fn(x, sel):
        return run(program.body, x, sel)

    return fn


# --- executor 2: the reference interpreter ---------------------------------------------------

class ReferenceFailure(Exception):
    """The program did something the reference considers an error (missing variable…)."""


@dataclass
class _Static:
    c: int = 0          # draw statements traced so far (Linen's count)


@dataclass
class _Dynamic:
    sub: Any
    i: int = 0
    linen: _Static | None = None   # in a loop of a Linen stream: the static count


def linen_draws(stmts: tuple, stream: str) -> int:
    """Draw statements of ``stream`` in ``stmts``, each once (what tracing counts)."""
    return sum(1 for s in walk(stmts) if (isinstance(s, Draw) and s.stream == stream)
               or (isinstance(s, Param) and stream == "params"))


def matches(mutable, col: str) -> bool:
    """Flax's collection filters: True / False / a name / a list of filters / DenyList."""
    if mutable is True:
        return True
    if mutable is False or mutable is None:
        return False
    if isinstance(mutable, str):
        return mutable == col
    if hasattr(mutable, "deny"):                      # vj.DenyList, by duck typing
        return not matches(mutable.deny, col)
    return any(matches(m, col) for m in mutable)


class _Reference:
    def __init__(self, program, variables, rng_keys, mutable, grad_mode=False, implicit=()):
        self.grad_mode = grad_mode
        self.in_custom = 0
        self.shape = program.shape
        self.store = {c: dict(v) for c, v in copy.deepcopy(dict(variables)).items()}
        self.keys = dict(rng_keys or {})
        self.rng = {s: _Static() for s in self.keys}
        for s in implicit:   # kept as state in variables['rngs']: dynamic from its count
            st_ = self.store["rngs"][s]
            self.keys[s] = st_["key"]
            self.rng[s] = _Dynamic(st_["key"], int(st_["count"]))
        self.mutable = mutable

    # variables
    def has(self, col, name):
        return name in self.store.get(col, {})

    def get(self, col, name):
        if not self.has(col, name):
            raise ReferenceFailure(f"read of missing variable {col}/{name}")
        return self.store[col][name]

    def put(self, col, name, value):
        if not matches(self.mutable, col):
            raise ReferenceFailure(f"write to immutable collection {col!r} ({name})")
        if self.in_custom:
            value = jax.tree.map(jax.lax.stop_gradient, value)
        self.store.setdefault(col, {})[name] = value

    def create(self, col, name, init):
        if not self.has(col, name):
            self.put(col, name, init())

    # rng
    def draw(self, stream):
        if stream not in self.keys:
            raise ReferenceFailure(f"missing rng stream {stream!r}")
        state = self.rng[stream]
        if isinstance(state, _Static):
            state.c += 1
            return streams.derive_at(self.keys[stream], (), state.c)
        key = state.sub
        if state.linen is not None:
            state.linen.c += 1
            key = streams.derive_at(key, (), state.linen.c)
        key = jax.random.fold_in(key, state.i)
        state.i += 1
        return key

    def _counts(self):
        """The Linen counts of every stream, where it is counting (top level or a loop)."""
        return {s: st_ if isinstance(st_, _Static) else st_.linen for s, st_ in self.rng.items()
                if isinstance(st_, _Static) or st_.linen is not None}

    def loop(self, body, run_iterations):
        """Run a loop: every stream its body draws from becomes dynamic inside it.
        ``run_iterations(begin)`` calls ``begin()`` before each iteration: the body's draw
        statements have the same counts in every iteration."""
        saved, starts = {}, {}
        for stream in sorted(drawn_streams(body)):
            state = self.rng[stream]
            saved[stream] = state
            if isinstance(state, _Static):                 # Linen: the loop key is the key
                counts = _Static(state.c)
                self.rng[stream] = _Dynamic(self.keys[stream], linen=counts)
            elif state.linen is not None:                  # nested: one dynamic draw of the outer
                sub = jax.random.fold_in(state.sub, state.i)
                state.i += 1
                counts = _Static(state.linen.c)
                self.rng[stream] = _Dynamic(sub, linen=counts)
            else:                                          # NNX state
                self.rng[stream] = _Dynamic(self.draw(stream))
                continue
            starts[stream] = counts.c

        def begin():
            for stream, c0 in starts.items():
                self.rng[stream].linen.c = c0
        out = run_iterations(begin)
        self.rng.update(saved)
        for stream in starts:
            counts = self._counts()[stream]
            counts.c += linen_draws(body, stream)
        return out

    def branch(self, branches, index, h, sel):
        """A cond / switch: tracing counts every branch's draws, in order."""
        counts = self._counts()
        starts = {s: c.c for s, c in counts.items()}
        for s, c in counts.items():
            c.c += sum(linen_draws(b, s) for b in branches[:index])
        h = self.run(branches[index], h, sel)
        for s, c in counts.items():
            c.c = starts[s] + sum(linen_draws(b, s) for b in branches)
        return h

    # execution
    def run(self, stmts, h, sel):
        for s in stmts:
            h = self.step(s, h, sel)
        return h

    def step(self, s, h, sel):
        shape = self.shape
        if isinstance(s, Param):
            if not self.has("params", s.name):
                if not matches(self.mutable, "params"):
                    raise ReferenceFailure(f"missing param {s.name}")
                self.put("params", s.name, _param_init(self.draw("params"), shape))
            return _mix_read(h, self.get("params", s.name), 0)
        if isinstance(s, Declare):
            if not self.has(s.col, s.name) and not matches(self.mutable, s.col):
                raise ReferenceFailure(f"cannot create {s.col}/{s.name}: immutable")
            self.create(s.col, s.name, _declare_init(shape, s.init))
            return h
        if isinstance(s, Read):
            return _mix_read(h, self.get(s.col, s.name), s.op)
        if isinstance(s, Write):
            old = self.get(s.col, s.name) if s.op else None
            if not s.op and not self.has(s.col, s.name):
                raise ReferenceFailure(f"write to missing variable {s.col}/{s.name}")
            self.put(s.col, s.name, _write_value(h, old, s.op))
            return h
        if isinstance(s, Draw):
            return _mix_draw(h, self.draw(s.stream), s.op)
        if isinstance(s, Sow):
            if not matches(self.mutable, s.col):
                return _mix_sow(h, False)
            if s.add:
                old = self.get(s.col, s.name) if self.has(s.col, s.name) else _zeros_init(shape)()
                self.put(s.col, s.name, _add(old, h))
            else:
                old = self.get(s.col, s.name) if self.has(s.col, s.name) else ()
                self.put(s.col, s.name, tuple(old) + (h,))
            return _mix_sow(h, True)
        if isinstance(s, (CustomJvp, CustomVjp)) and self.grad_mode:
            # The custom rules pass the tangent / cotangent of h straight through and say
            # nothing about variables: what the body writes has a zero derivative.
            self.in_custom += 1
            try:
                return h + jax.lax.stop_gradient(self.run(s.body, h, sel) - h)
            finally:
                self.in_custom -= 1
        if isinstance(s, WRAPPERS):
            return self.run(s.body, h, sel)
        if isinstance(s, Scan):
            def iterations(begin):
                carry, ys = h, []
                for x in np.arange(s.length, dtype=np.float32):
                    begin()
                    carry = self.run(s.body, _scan_in(carry, jnp.asarray(x)), sel)
                    ys.append(carry * 0.5)
                ys = jnp.stack(ys) if ys else jnp.zeros((0,) + shape, F32)
                return _scan_out(carry, ys)
            return self.loop(s.body, iterations)
        if isinstance(s, While):
            def cond(i):
                ok = i < _while_bound(s.n, sel)
                for col, name in s.cond_reads:
                    ok = ok & _while_read_ok(self.get(col, name))
                return bool(ok)

            def iterations(begin):
                i, hh = 0, h
                while cond(i):
                    begin()
                    i, hh = i + 1, self.run(s.body, hh, sel)
                return hh
            return self.loop(s.body, iterations)
        if isinstance(s, Cond):
            taken = 0 if bool(_cond_pred(s.pred, h, sel)) else 1
            return self.branch([s.true, s.false], taken, h, sel)
        if isinstance(s, Switch):
            index = int(_switch_index(s.index, h, sel))
            index = min(max(index, 0), len(s.branches) - 1)
            return self.branch(list(s.branches), index, h, sel)
        raise TypeError(s)


def reference_run(program: Program, variables: dict, args: tuple, rng_keys: dict | None,
                  mutable, grad_mode: bool = False, implicit: tuple = ()) -> tuple[Any, dict]:
    """Run ``program`` eagerly over a dict store.

    Returns ``(out, updated)`` where ``updated`` holds every collection matching
    ``mutable``, in full, collections without variables omitted.  With
    ``grad_mode`` the custom_jvp / custom_vjp bodies get the identity derivative
    their rules define (the forward value may then differ in the last bit) and
    the variables they write get a zero derivative, so ``jax.grad`` of this
    function is the reference gradient.  Streams in ``implicit`` are kept as state in
    ``variables['rngs']`` (``{'key', 'count'}``): every draw is dynamic, ``fold_in(key,
    count)``, and the final count is stored back.
    """
    x, sel = args
    ref = _Reference(program, variables, rng_keys, mutable, grad_mode, implicit)
    out = ref.run(program.body, jnp.asarray(x, F32) if not grad_mode else x,
                  jnp.asarray(sel, jnp.int32))
    for s in implicit:
        ref.store["rngs"][s] = {"key": ref.keys[s], "count": jnp.uint32(ref.rng[s].i)}
    updated = {c: dict(vs) for c, vs in ref.store.items() if vs and matches(mutable, c)}
    return out, updated


# --- the hypothesis strategy -----------------------------------------------------------------

@dataclass(frozen=True)
class _Ctx:
    depth: int = 0
    restricted: bool = False   # inside a loop or a cond/switch branch
    top: bool = True           # the function's own top level (not even inside a jit)


class _Generator:
    def __init__(self, draw, max_depth: int, max_block: int):
        self.draw = draw
        self.max_depth = max_depth
        self.max_block = max_block
        self.declared: list[tuple[str, str]] = []   # plain variables, in declaration order
        self.add_sown: list[tuple[str, str]] = []   # additive-sow variables (existing)
        self.tuple_sown: list[tuple[str, str]] = []  # tuple-sow variables
        self.counter = 0

    def fresh(self, prefix):
        self.counter += 1
        return f"{prefix}{self.counter}"

    def block(self, ctx: _Ctx, min_size: int, max_size: int) -> tuple:
        n = self.draw(st.integers(min_size, max_size))
        return tuple(self.stmt(ctx) for _ in range(n))

    def stmt(self, ctx: _Ctx) -> Stmt:
        d = self.draw
        kinds = []
        if self.declared:
            kinds += ["read", "write", "read", "write"]
        kinds += ["draw", "draw"]
        if not ctx.restricted:
            kinds += ["declare", "sow_tuple"]
        if ctx.top:
            kinds.append("param")
        if self.add_sown or not ctx.restricted:
            kinds.append("sow_add")
        hops = ["jit", "scan", "cond", "while", "switch", "checkpoint", "custom_jvp", "custom_vjp"]
        if ctx.depth < self.max_depth and d(st.booleans()):    # half the statements nest
            kinds = hops
        kind = d(st.sampled_from(kinds))

        if kind == "read":
            col, name = d(st.sampled_from(self.declared))
            return Read(col, name, d(st.integers(0, 2)))
        if kind == "write":
            col, name = d(st.sampled_from(self.declared))
            return Write(col, name, d(st.integers(0, 2)))
        if kind == "draw":
            return Draw(d(st.sampled_from(STREAMS)), d(st.integers(0, 2)))
        if kind == "declare":
            col = d(st.sampled_from(("state", "stats")))
            name = self.fresh("v")
            self.declared.append((col, name))
            return Declare(col, name, d(st.sampled_from((0.0, 0.5, -0.25))))
        if kind == "param":
            name = self.fresh("w")
            self.declared.append(("params", name))
            return Param(name)
        if kind == "sow_tuple":
            if self.tuple_sown and d(st.booleans()):     # append to an existing tuple
                col, name = d(st.sampled_from(self.tuple_sown))
            else:
                col, name = d(st.sampled_from(("stats", "state"))), self.fresh("t")
                self.tuple_sown.append((col, name))
            return Sow(col, name, add=False)
        if kind == "sow_add":
            if self.add_sown and (ctx.restricted or d(st.booleans())):
                col, name = d(st.sampled_from(self.add_sown))
            else:
                col, name = d(st.sampled_from(("stats", "state"))), self.fresh("a")
                self.add_sown.append((col, name))
            return Sow(col, name, add=True)

        inner = dataclasses.replace(ctx, depth=ctx.depth + 1, top=False)
        looped = dataclasses.replace(inner, restricted=True)
        if kind == "jit":
            return Jit(self.block(inner, 1, self.max_block))
        if kind == "checkpoint":
            return Checkpoint(self.block(inner, 1, self.max_block))
        if kind == "custom_jvp":
            return CustomJvp(self.block(inner, 1, self.max_block))
        if kind == "custom_vjp":
            return CustomVjp(self.block(inner, 1, self.max_block))
        if kind == "scan":
            length = d(st.integers(0, 3))
            return Scan(self.block(looped, 1, self.max_block), length)
        if kind == "while":
            n = d(st.one_of(st.none(), st.integers(0, 3)))
            reads = ()
            if self.declared:
                reads = tuple(d(st.lists(st.sampled_from(self.declared), max_size=2)))
            return While(self.block(looped, 1, self.max_block), n, reads)
        if kind == "cond":
            pred = d(st.sampled_from(("h", "sel")))
            return Cond(pred, self.block(looped, 0, self.max_block),
                        self.block(looped, 0, self.max_block))
        if kind == "switch":
            index = d(st.sampled_from(("h", "sel")))
            n = d(st.integers(1, 3))
            return Switch(index, tuple(self.block(looped, 0, self.max_block) for _ in range(n)))
        raise AssertionError(kind)


@st.composite
def programs(draw, max_depth: int = MAX_DEPTH, max_top: int = 5, max_block: int = 2):
    """Random ``Program``s: top level of 1..max_top statements, nesting ≤ ``max_depth``."""
    shape = draw(st.sampled_from(((), (2,))))
    gen = _Generator(draw, max_depth, max_block)
    # A prelude of declarations, so that nested code has variables to read and write.
    prelude = []
    for _ in range(draw(st.integers(0, 3))):
        if draw(st.booleans()):
            name = gen.fresh("w")
            gen.declared.append(("params", name))
            prelude.append(Param(name))
        else:
            col, name = draw(st.sampled_from(("state", "stats"))), gen.fresh("v")
            gen.declared.append((col, name))
            prelude.append(Declare(col, name, draw(st.sampled_from((0.0, 0.5, -0.25)))))
    return Program(tuple(prelude) + gen.block(_Ctx(), 1, max_top), shape)


def make_args(shape: tuple, seed: int, sel: int):
    x = np.random.default_rng(seed).uniform(-1.0, 1.0, shape).astype(np.float32)
    return jnp.asarray(x), jnp.asarray(sel, jnp.int32)


def init_and_apply(program: Program) -> tuple[Any, tuple, list[dict]]:
    """``program`` as a functionalized function, its arguments, and the keywords of two
    calls of it: an init (no variables, all mutable: forward-stores leaves dead reads) and
    an apply of the variables it made (nothing mutable: usually nothing dead)."""
    import varjax as vj
    f = vj.functionalize(build_varjax_fn(program))
    args = make_args(program.shape, 0, 1)
    rngs = {"params": jax.random.key(0), "dropout": jax.random.key(1)}
    variables = f.init(rngs, *args)
    return f, args, [{"variables": {}, "rngs": rngs, "mutable": True},
                     {"variables": variables, "rngs": rngs, "mutable": False}]

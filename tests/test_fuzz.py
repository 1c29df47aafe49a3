"""Fuzz: random effectful programs, functionalized by varjax vs. an eager dict-store reference.

Each example generates a program (``tests/fuzz/programs.py``) of variable reads, writes, RNG
draws and ``sow``s over the collections ``params`` / ``state`` / ``stats`` and the streams
``params`` / ``dropout``, nested up to depth 3 in jit / scan / while / cond / switch /
checkpoint / custom_jvp / custom_vjp, and checks

* ``init`` against the reference run on an empty store with everything mutable;
* ``apply(variables, mutable=True)`` against the reference;
* ``apply`` with a partial ``mutable`` (every written collection plus a random few, as a name,
  a list or a ``vj.DenyList``; ``False`` when nothing is written), some of the mutable
  collections left out of the variables so that apply re-creates them, against the reference;
* for a quarter of the examples, the derivative of ``sum(apply(...)[0])`` w.r.t. ``x``
  (reverse mode, or forward mode across while loops) against ``jax.grad`` / ``jax.jvp`` of the
  reference, where custom_jvp / custom_vjp bodies have the identity derivative of their rules.

The PRNG is threefry for a quarter of the examples and a cheap-to-compile hash generator
(``P.CHEAP_PRNG``) for the rest: XLA spends ~0.1 s compiling each threefry hash on CPU.

``VARJAX_FUZZ_EXAMPLES`` sets the number of examples (default 200, derandomized);
``make fuzz`` runs 10,000 and the session prints ``fuzz: N examples checked``.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from varjax.ir import streams

sys.path.insert(0, os.path.dirname(__file__))
from fuzz import programs as P  # noqa: E402
from fuzz.programs import (  # noqa: E402
    Checkpoint,
    Cond,
    CustomJvp,
    CustomVjp,
    Declare,
    Draw,
    Jit,
    Param,
    Program,
    Read,
    Scan,
    Sow,
    Switch,
    While,
    Write,
)

_ENV = "VARJAX_FUZZ_EXAMPLES"
EXAMPLES = int(os.environ.get(_ENV, "200"))
# CI (no env var): a fixed example sequence.  An explicit count (`make fuzz`): fresh randomness.
DERANDOMIZE = os.environ.get("VARJAX_FUZZ_DERANDOMIZE", "1" if _ENV not in os.environ else "0") == "1"

_checked = 0


# --- comparison ------------------------------------------------------------------------------

def _plain(x) -> np.ndarray:
    """A NumPy array; a typed PRNG key as its key data."""
    if jax.dtypes.issubdtype(jnp.asarray(x).dtype, jax.dtypes.prng_key):
        return np.asarray(jax.random.key_data(x))
    return np.asarray(x)


def assert_trees_close(actual, expected, what: str) -> None:
    a_tree, e_tree = jax.tree.structure(actual), jax.tree.structure(expected)
    assert a_tree == e_tree, f"{what}: structure differs\n varjax:    {a_tree}\n reference: {e_tree}"
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(expected)]
    for path, a, e in zip(paths, jax.tree.leaves(actual), jax.tree.leaves(expected)):
        a, e = _plain(a), _plain(e)
        assert a.shape == e.shape and a.dtype == e.dtype, \
            f"{what}{path}: varjax {a.dtype}{a.shape} vs reference {e.dtype}{e.shape}"
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5, err_msg=f"{what}{path}")


# --- one example -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    program: Program
    seed: int
    sel: int
    init_with_dict: bool        # init(rngs={'params':…, 'dropout':…}) instead of init(key)
    extra_mutable: tuple        # collections added to the written ones for the partial apply
    mutable_as_str: bool        # a single partial collection passed as 'name' rather than ['name']
    check_grad: bool = False    # also compare jax.grad of apply w.r.t. x
    prng: str = "threefry"      # key implementation, see P.PRNG_IMPLS
    grad_partial: bool = False  # differentiate apply with the partial mutable, not mutable=True
    drop: tuple = ()            # collections the partial apply re-creates instead of being given
    mutable_deny: bool = False  # the partial mutable as vj.DenyList(the other collections)
    implicit: bool = False      # also apply with 'dropout' kept as state in collection 'rngs'

    def partial_mutable(self):
        cols = sorted(P.written_collections(self.program) | set(self.extra_mutable))
        if not cols:
            return False
        if self.mutable_deny:
            import varjax as vj
            return vj.DenyList([c for c in P.COLLECTIONS if c not in cols])
        if len(cols) == 1 and self.mutable_as_str:
            return cols[0]
        return cols


@st.composite
def cases(draw, **program_kwargs):
    return Case(
        program=draw(P.programs(**program_kwargs)),
        seed=draw(st.integers(0, 2**16)),
        sel=draw(st.integers(0, 4)),
        init_with_dict=draw(st.booleans()),
        extra_mutable=tuple(sorted(draw(st.sets(st.sampled_from(P.COLLECTIONS))))),
        mutable_as_str=draw(st.booleans()),
        check_grad=draw(st.integers(0, 3)) == 0,
        prng=draw(st.sampled_from(("cheap", "cheap", "cheap", "threefry"))),
        grad_partial=draw(st.booleans()),
        drop=tuple(sorted(draw(st.sets(st.sampled_from(P.COLLECTIONS))))),
        mutable_deny=draw(st.integers(0, 3)) == 0,
        implicit=draw(st.integers(0, 2)) == 0,
    )


def rng_keys(seed: int, prng: str = "threefry") -> dict:
    impl = P.PRNG_IMPLS[prng]
    return {"params": jax.random.key(seed, impl=impl), "dropout": jax.random.key(seed + 1, impl=impl)}


def _custom_reads(stmts) -> set:
    """Variables read inside custom_jvp / custom_vjp bodies (a sow reads what it adds to)."""
    out = set()
    for s in P.walk(stmts):
        if isinstance(s, (CustomJvp, CustomVjp)):
            for t in P.walk(s.body):
                if isinstance(t, (Read, Sow)) or (isinstance(t, Write) and t.op):
                    out.add((t.col, t.name))
                elif isinstance(t, While):
                    out.update(t.cond_reads)
    return out


def derivative_mode(prog: Program) -> str | None:
    """How to differentiate ``prog`` w.r.t. ``x``, or ``None`` to skip.

    Reverse mode cannot cross a while loop, forward mode cannot cross a custom_vjp.  A
    variable read inside a raw custom_jvp / custom_vjp must not depend on ``x`` (varjax raises
    ``TransformError``, as JAX does for closed-over tracers): skip programs where such a
    variable is written anywhere.
    """
    written = {(s.col, s.name) for s in P.walk(prog.body) if isinstance(s, (Write, Sow))}
    if _custom_reads(prog.body) & written:
        return None
    kinds = {type(s) for s in P.walk(prog.body)}
    if While in kinds:
        return None if CustomVjp in kinds else "fwd"
    return "rev"


def derivative(loss, x, mode: str):
    if mode == "rev":
        return jax.grad(loss)(x)
    return jax.jvp(loss, (x,), (jnp.ones_like(x),))[1]


def check_case(case: Case) -> None:
    import varjax as vj

    prog = case.program
    fn = vj.functionalize(P.build_varjax_fn(prog))
    x, sel = P.make_args(prog.shape, case.seed, case.sel)
    desc = f"\n{prog}\nseed={case.seed} sel={case.sel} prng={case.prng}"

    # init: everything mutable, empty store.
    init_keys = rng_keys(case.seed, case.prng)
    if not case.init_with_dict and "dropout" not in P.drawn_streams(prog.body):
        init_rngs, init_keys = init_keys["params"], {"params": init_keys["params"]}
    else:
        init_rngs = init_keys
    variables = fn.init(init_rngs, x, sel)
    _, expected = P.reference_run(prog, {}, (x, sel), init_keys, True)
    assert_trees_close(variables, expected, "init" + desc + "\nvariables")

    # apply, everything mutable, fresh keys.
    keys = rng_keys(case.seed + 7, case.prng)
    out, updated = fn.apply(variables, x, sel, rngs=keys, mutable=True)
    ref_out, ref_updated = P.reference_run(prog, variables, (x, sel), keys, True)
    assert_trees_close(out, ref_out, "apply(mutable=True)" + desc + "\nout")
    assert_trees_close(updated, ref_updated, "apply(mutable=True)" + desc + "\nupdated")

    # apply, everything mutable, 'dropout' as implicit state (its count drives the draws).
    if case.implicit and "dropout" in P.drawn_streams(prog.body):
        state = {"dropout": {"key": keys["dropout"], "count": jnp.uint32(case.seed % 7)}}
        with_state = {**variables, "rngs": state}
        out, updated = fn.apply(with_state, x, sel, rngs={"params": keys["params"]}, mutable=True)
        ref_out, ref_updated = P.reference_run(prog, with_state, (x, sel), {"params": keys["params"]},
                                               True, implicit=("dropout",))
        assert_trees_close(out, ref_out, "apply(implicit dropout)" + desc + "\nout")
        assert_trees_close(updated, ref_updated, "apply(implicit dropout)" + desc + "\nupdated")

    # apply, partial mutability.
    # Mutable collections in `drop` are left out of the variables: apply re-creates them.
    mutable = case.partial_mutable()
    partial_vars = {c: v for c, v in variables.items()
                    if not (c in case.drop and P.matches(mutable, c))}
    ref_out, ref_updated = P.reference_run(prog, partial_vars, (x, sel), keys, mutable)
    what = f"apply(mutable={mutable!r}, collections given: {sorted(partial_vars)})" + desc
    if mutable is False:
        out = fn.apply(partial_vars, x, sel, rngs=keys)
        assert_trees_close(out, ref_out, what + "\nout")
    else:
        out, updated = fn.apply(partial_vars, x, sel, rngs=keys, mutable=mutable)
        assert_trees_close(out, ref_out, what + "\nout")
        assert_trees_close(updated, ref_updated, what + "\nupdated")

    mode = derivative_mode(prog) if case.check_grad else None
    if mode is not None:
        grad_mutable, grad_vars = (mutable, partial_vars) if case.grad_partial else (True, variables)

        def loss(x):
            out = fn.apply(grad_vars, x, sel, rngs=keys, mutable=grad_mutable)
            return jnp.sum(out if grad_mutable is False else out[0])

        def ref_loss(x):
            out, _ = P.reference_run(prog, grad_vars, (x, sel), keys, grad_mutable, grad_mode=True)
            return jnp.sum(out)
        assert_trees_close(derivative(loss, x, mode), derivative(ref_loss, x, mode),
                           f"{mode} derivative of apply(mutable={grad_mutable!r})" + desc)

    global _checked
    _checked += 1
    if _checked % 500 == 0:     # every example compiles new programs: bound the caches' memory
        jax.clear_caches()


# --- the fuzz test ---------------------------------------------------------------------------

@settings(max_examples=EXAMPLES, deadline=None, derandomize=DERANDOMIZE, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(cases())
def _fuzz(case: Case) -> None:
    check_case(case)


def test_fuzz_programs(report):
    before = _checked
    _fuzz()
    report(f"fuzz: {_checked - before} examples checked")


# --- hand-written programs: one per construct, so a failure names the construct -------------

S = (2,)
_HAND = {
    "straight_line": Program((Param("w"), Declare("state", "v", 0.5), Read("state", "v", 1),
                              Write("state", "v", 1), Draw("dropout", 0), Draw("params", 2),
                              Sow("stats", "t", False), Sow("stats", "t", False)), S),
    "jit": Program((Declare("state", "v", 0.0), Jit((Declare("stats", "u", 0.5),
                                                     Read("stats", "u", 0), Write("state", "v", 0),
                                                     Draw("dropout", 0), Sow("stats", "t", False))),
                    Read("state", "v", 2), Draw("dropout", 1)), ()),
    "scan": Program((Param("w"), Declare("state", "v", 0.0), Sow("stats", "a", True),
                     Scan((Read("params", "w", 1), Write("state", "v", 1), Draw("dropout", 0),
                           Sow("stats", "a", True)), 3), Draw("dropout", 0)), S),
    "while": Program((Declare("state", "v", 0.5),
                      While((Write("state", "v", 2), Draw("params", 0)), None,
                            (("state", "v"),))), S),
    "cond": Program((Declare("state", "v", 0.0), Declare("stats", "u", 0.0),
                     Cond("h", (Write("state", "v", 0), Draw("dropout", 0)),
                          (Write("stats", "u", 1), Draw("dropout", 1), Draw("dropout", 2))),
                     Draw("dropout", 0)), S),
    "switch": Program((Declare("state", "v", 0.0),
                       Switch("sel", ((Draw("dropout", 0),), (), (Write("state", "v", 1),))),
                       Draw("dropout", 0)), ()),
    "checkpoint": Program((Declare("state", "v", 0.0),
                           Checkpoint((Read("state", "v", 0), Write("state", "v", 0),
                                       Draw("dropout", 2))),), S),
    "custom_jvp": Program((Declare("state", "v", 0.0),
                           CustomJvp((Declare("stats", "u", 0.5), Write("state", "v", 1),
                                      Read("stats", "u", 1), Draw("params", 0))),), S),
    "custom_vjp": Program((Declare("state", "v", 0.0),
                           CustomVjp((Write("state", "v", 1), Draw("dropout", 0),
                                      Sow("stats", "t", False))),), ()),
    "nested_loops": Program((Declare("state", "v", 0.0),
                             Scan((Draw("dropout", 0),
                                   While((Draw("dropout", 1), Write("state", "v", 1)), 2, ()),
                                   Cond("sel", (Scan((Draw("dropout", 2),), 2),), ())), 2),
                             Draw("dropout", 0)), S),
    # Custom-rule bodies that bind no varjax primitive in apply (the variable exists / the
    # collection is immutable): JAX traces their rules lazily, at differentiation time.
    "custom_jvp_declare_only": Program((CustomJvp((Declare("state", "v", 0.5),)),
                                        Read("state", "v", 1)), S),
    "custom_vjp_declare_only": Program((CustomVjp((Declare("state", "v", 0.5),)),
                                        Read("state", "v", 1)), S),
    "custom_jvp_sow_only": Program((CustomJvp((Sow("stats", "t", False),)),), S),
    "custom_jvp_declare_only_in_jit": Program((Jit((CustomJvp((Declare("state", "v", 0.5),)),)),
                                               Read("state", "v", 1)), S),
    "custom_vjp_declare_only_in_checkpoint": Program(
        (Checkpoint((CustomVjp((Declare("state", "v", 0.5),)),)), Read("state", "v", 1)), S),
    "custom_vjp_draw_in_scan": Program((Scan((CustomVjp((Draw("dropout", 0),)),), 2),), S),
    "depth3": Program((Declare("state", "v", 0.0), Sow("stats", "a", True),
                       Jit((Checkpoint((Switch("h", ((Sow("stats", "a", True),),
                                                     (Write("state", "v", 0),))),)),)),
                       CustomVjp((Cond("sel", (Scan((Read("state", "v", 0),
                                                     Sow("stats", "a", True)), 2),), ()),))), S),
}


@pytest.mark.parametrize("name", sorted(_HAND))
@pytest.mark.parametrize("sel,prng", [(0, "threefry"), (1, "cheap")])
def test_hand_written(name, sel, prng):
    # sel 1: the gradient is taken with only the written collections mutable, the others given.
    check_case(Case(_HAND[name], seed=3, sel=sel, init_with_dict=True, extra_mutable=(),
                    mutable_as_str=True, check_grad=True, prng=prng, grad_partial=sel == 1))


# --- the reference itself (no varjax involved) -----------------------------------------------

def test_reference_static_and_dynamic_draws():
    """The reference's RNG semantics for explicit keys: Linen's convention at the root path
    (``h(c)``: draw statement ``c`` in trace order)."""
    keys = rng_keys(0)
    k = keys["dropout"]
    x = jnp.zeros((), jnp.float32)

    def h_(c, key=k):
        return streams.derive_at(key, (), c)
    # two straight-line draws: counts 1 and 2
    prog = Program((Draw("dropout", 0), Draw("dropout", 0)), ())
    out, _ = P.reference_run(prog, {}, (x, 0), keys, True)
    h = P._mix_draw(P._mix_draw(x, h_(1), 0), h_(2), 0)
    np.testing.assert_array_equal(out, h)
    # a drawing loop: its draw statement is count 1, and iteration i folds i into that key;
    # the draw after it is count 2.
    prog = Program((Scan((Draw("dropout", 0),), 2), Draw("dropout", 0)), ())
    out, _ = P.reference_run(prog, {}, (x, 0), keys, True)
    h = x
    ys = []
    for i in range(2):
        h = P._mix_draw(P._scan_in(h, jnp.float32(i)), jax.random.fold_in(h_(1), i), 0)
        ys.append(h * 0.5)
    h = P._mix_draw(P._scan_out(h, jnp.stack(ys)), h_(2), 0)
    np.testing.assert_array_equal(out, h)
    # cond: every branch is traced, in order (true first), so the draw after is count 4
    # whichever branch ran; the false branch's draws are counts 2 and 3.
    prog = Program((Cond("sel", (Draw("dropout", 0),), (Draw("dropout", 0), Draw("dropout", 0))),
                    Draw("dropout", 1)), ())
    out, _ = P.reference_run(prog, {}, (x, 0), keys, True)    # sel 0: true branch
    h = P._mix_draw(P._mix_draw(x, h_(1), 0), h_(4), 1)
    np.testing.assert_array_equal(out, h)


def test_reference_sow_and_mutability():
    prog = Program((Declare("state", "v", 0.5), Sow("stats", "t", False), Sow("stats", "t", False),
                    Sow("stats", "a", True), Write("state", "v", 0)), ())
    x = jnp.float32(0.25)
    out, upd = P.reference_run(prog, {}, (x, 0), {}, True)
    assert set(upd) == {"state", "stats"} and len(upd["stats"]["t"]) == 2
    out2, upd2 = P.reference_run(prog, upd, (x, 0), {}, ["state"])
    assert set(upd2) == {"state"}
    np.testing.assert_allclose(out2, x - 0.03)     # every sow is a no-op returning False
    with pytest.raises(P.ReferenceFailure):
        P.reference_run(prog, upd, (x, 0), {}, ["stats"])


@settings(max_examples=50, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(cases())
def test_generated_programs_follow_the_rules(case):
    """Every generated program runs under the reference for init and both applies."""
    prog = case.program
    x, sel = P.make_args(prog.shape, case.seed, case.sel)
    keys = rng_keys(case.seed)
    _, variables = P.reference_run(prog, {}, (x, sel), keys, True)
    P.reference_run(prog, variables, (x, sel), keys, True)
    P.reference_run(prog, variables, (x, sel), keys, case.partial_mutable())
    assert P.format_program(prog)

"""The headline demo: one block of a Linen CNN as effectful IR, as pure IR, then training.

1. A ``ConvBlock`` of the digits CNN (``examples/digits.py``), called with ``train=True`` and
   ``batch_stats`` mutable: its jaxpr as traced, where BatchNorm's running averages are
   ``var_get`` / ``var_set`` equations, then the pure jaxpr the pass pipeline discharges it
   into, where they are inputs and outputs.
2. The IR after every pass, written as numbered files (with a diff per changing pass) by
   ``vj.dump(..., to=DIR)``; DIR is ``$VARJAX_DUMP_DIR`` if set, else ``dumps/demo``.
3. The whole CNN's training call as a variable dataflow picture (``vj.dataflow(...).render``,
   through Graphviz when it is installed): ``examples/out/demo_dataflow.svg``.
4. The whole CNN trained on scikit-learn's digits (``digits.train()``), and its loss curve
   (with matplotlib): ``examples/out/digits_loss.png``.

Measured on 2 CPU cores shared with other jobs: 23 s in all (a quiet machine takes about
half), 98.89% test accuracy.

Run: ``make demo`` (or ``python examples/demo.py`` from the repository root).
"""
from __future__ import annotations

import os
from pathlib import Path

import jax
import jax.numpy as jnp
from common import OUT, plot_losses
from common import digits as digits_data
from digits import CNN, ConvBlock, train

import varjax as vj

REPO = Path(__file__).resolve().parent.parent


def header(title: str) -> None:
    print(f"\n{'=' * 100}\n{title}\n{'=' * 100}")


def shown(path: Path) -> str:
    """``path`` relative to the working directory when it is below it (shorter to read)."""
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def show_ir(block: ConvBlock, x: jax.Array, variables: dict) -> None:
    """The block's effectful and pure jaxprs.  ``train`` is a Python bool, so it is static:
    each value gets its own trace, and this one is the training trace."""
    fn = block.functionalize()
    call = dict(variables=variables, mutable=["batch_stats"], train=True)
    print("-- effectful jaxpr, as traced: variables are read and written in place --")
    text = vj.pretty(fn.jaxpr(x, **call), source=True)
    print(text.replace(f"{REPO}/", "").replace(" (ConvBlock.__call__)", ""))  # shorter lines
    traced = fn.traced(x, **call)
    print(f"\n-- pure jaxpr after the pipeline {fn.pipeline} --")
    inputs = [f"{col}:{'/'.join(path)}" for (col, path), _ in traced.signature.inputs]
    outputs = [f"{col}:{'/'.join(path)}" for (col, path), _ in traced.signature.outputs]
    print(f"inputs:  {', '.join(inputs)}, then x")
    print(f"outputs: y, then {', '.join(outputs)}")
    print(vj.pretty(traced.pure))


def write_dumps(block: ConvBlock, x: jax.Array, variables: dict) -> None:
    """``vj.dump`` re-runs the pipeline with a recorder, uncached, and writes one file per
    stage into a new numbered run directory, so earlier runs stay for comparison."""
    out = Path(os.environ.get("VARJAX_DUMP_DIR") or REPO / "dumps" / "demo")
    before = set(out.iterdir()) if out.is_dir() else set()
    entries = vj.dump(block, x, variables=variables, mutable=["batch_stats"], train=True, to=out)
    (run_dir,) = set(out.iterdir()) - before
    print(f"  {entries[0][1].splitlines()[0].removeprefix('// ')}")
    for name, text in entries[1:]:
        print(f"  {name:18s} {'changed' if '(changed)' in text.splitlines()[0] else 'unchanged'}")
    print(f"\nwritten to {shown(run_dir)}/:")
    print("  " + "  ".join(sorted(f.name for f in run_dir.iterdir())))


def draw_dataflow(x: jax.Array, path: Path) -> None:
    """Which params and batch statistics feed the logits and the new running averages, and
    where the dropout stream enters: the CNN's training call as a dataflow picture."""
    model = CNN()
    variables = model.init(jax.random.key(0), x)
    graph = vj.dataflow(model, x, variables=variables, train=True, mutable=["batch_stats"],
                        rngs={"dropout": jax.random.key(1)})
    print(f"{graph.number_of_nodes()} nodes, {graph.number_of_edges()} edges")
    try:
        print(f"wrote {shown(graph.render(path))}")
    except vj.errors.MissingDependencyError as e:   # Graphviz is not installed
        print(f"no picture: {e.what}\n  fix: {e.fix}")


def main() -> None:
    x = jnp.asarray(digits_data()[0][:4])
    block = ConvBlock(features=8)
    variables = block.init(jax.random.key(0), x)
    header(f"1. One block of the digits CNN: ConvBlock(8) on f32{list(x.shape)}, train=True, "
           "mutable=['batch_stats']")
    print("variables:", jax.tree.map(lambda a: f"{a.dtype}{list(a.shape)}", variables), "\n")
    show_ir(block, x, variables)

    header("2. The IR after every pass: vj.dump(block, x, ..., to=DIR)")
    write_dumps(block, x, variables)

    header("3. The CNN's variable dataflow: vj.dataflow(model, x, ...).render(PATH)")
    draw_dataflow(x, OUT / "demo_dataflow.svg")

    header("4. Training the digits CNN (two ConvBlocks, Dense, Dropout; adam; batch_stats mutable)")
    result = train()
    print(f"digits: test accuracy {result['test_acc']:.2%} in {result['seconds']:.1f} s")
    plot_losses("digits", {"CNN": result["losses"]}, log_y=True)


if __name__ == "__main__":
    main()

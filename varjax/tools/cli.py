"""``python -m varjax``: dump the IR or summarize the variables of code in a file.

    python -m varjax dump model.py:loss --shape x=f32[8,256] --after discharge
    python -m varjax dump model.py:loss --shape x=f32[8,256] --out dumps/ --dot flow.dot
    python -m varjax dump model.py:loss --shape x=f32[8,256] --svg flow.svg --png flow.png
    python -m varjax summary model.py:MLP --shape x=f32[8,256] --detail

``FILE:NAME`` loads the file as a module and takes its attribute ``NAME``: a function, a
``vj.functionalize``-d function, a Module class (constructed with no arguments), a Module
instance, or a ``functools.partial`` of a function, a module or a module's method. Each
``--shape`` adds one positional argument of zeros. ``dump`` initializes the variables with
key 0 and then shows the effectful IR and the IR after every pass. Each file or folder it
writes (``--out``'s run folder, ``--dot``, ``--svg``, ``--png``) then gets a line ``wrote
PATH``, relative to the current folder. ``--svg``/``--png`` draw the dataflow graph through
Graphviz (``varjax.tools.dot``).

Exit status: 0 on success, 2 for usage errors, 1 when varjax reports an error (its message is
printed, without a traceback: it already names the variable and the user's line).
"""
from __future__ import annotations

# Only the standard library at the top: ``--help`` and usage errors answer before JAX and
# varjax's internals are imported (they take about a second); ``main`` imports them once
# the arguments parse.
import argparse
import importlib.util
import os
import re
import sys
from pathlib import Path
from typing import Any, Sequence

DTYPES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16", "f64": "float64",
          "i8": "int8", "i16": "int16", "i32": "int32", "i64": "int64",
          "u8": "uint8", "u32": "uint32", "bool": "bool"}
_SHAPE = re.compile(r"(?P<name>\w+)=(?P<dtype>\w+)\[(?P<dims>[\d,\s]*)\]")


def _check_shape(spec: str) -> str:
    """``--shape``'s argparse type: the spec's syntax and dtype name, without JAX."""
    match = _SHAPE.fullmatch(spec.strip())
    if match is None:
        raise argparse.ArgumentTypeError(
            f"bad shape spec {spec!r}: expected NAME=DTYPE[DIMS], e.g. x=f32[8,256] or n=i32[]")
    if match["dtype"] not in DTYPES:
        raise argparse.ArgumentTypeError(
            f"bad shape spec {spec!r}: unknown dtype {match['dtype']!r} (known: {', '.join(DTYPES)})")
    return spec


def parse_shape(spec: str) -> tuple[str, Any]:
    """``"x=f32[8,256]"`` -> ``("x", ShapeDtypeStruct((8, 256), float32))``; ``f32[]`` is a
    scalar.  Raises ``argparse.ArgumentTypeError`` (a usage error) on a bad spec."""
    import jax
    import jax.numpy as jnp

    match = _SHAPE.fullmatch(_check_shape(spec).strip())
    dtype = jnp.dtype(DTYPES[match["dtype"]])
    if dtype.itemsize == 8 and not jax.config.jax_enable_x64:
        # JAX would silently make it 32-bit; the user asked for 64.
        raise argparse.ArgumentTypeError(
            f"bad shape spec {spec!r}: 64-bit dtypes need JAX_ENABLE_X64=1 in the environment")
    dims = tuple(int(d) for d in match["dims"].split(",") if d.strip())
    return match["name"], jax.ShapeDtypeStruct(dims, dtype)


def load_target(ref: str) -> Any:
    """``FILE:NAME`` -> the object to inspect (see the module docstring)."""
    file, sep, name = ref.rpartition(":")
    if not sep or not file or not name:
        raise ValueError(f"expected FILE:NAME, got {ref!r}")
    path = Path(file)
    if not path.is_file():
        raise ValueError(f"no such file: {file}")
    # Like `python FILE`: the file's folder is importable, and the module is registered
    # (dataclasses, hence Modules, look their module up in sys.modules).
    sys.path.insert(0, str(path.resolve().parent))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    if not hasattr(module, name):
        raise ValueError(f"{file} has no attribute {name!r}")
    target = getattr(module, name)
    from varjax.nn.module import Module

    if isinstance(target, type) and issubclass(target, Module):
        return target()
    if not callable(target):
        raise ValueError(f"{file}:{name} is a {type(target).__name__}, not a function or Module")
    return target


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m varjax", description="Inspect stateful JAX code traced by varjax.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help, description=help)
        sub.add_argument("target", metavar="FILE:NAME",
                         help="a function, functionalized function, Module class or instance")
        sub.add_argument("--shape", type=_check_shape, action="append", default=[],
                         metavar="NAME=DTYPE[DIMS]",
                         help="one positional argument of zeros, e.g. x=f32[8,256]; repeat in "
                              f"argument order; dtypes: {', '.join(DTYPES)}")
        sub.add_argument("--rng", action="append", default=[], metavar="STREAM",
                         help="an RNG stream the code draws from besides 'params' (repeatable)")
        return sub

    dumper = command("dump", "print the effectful IR and the IR after every pass")
    dumper.add_argument("--after", metavar="PASS", help="print only the IR after this pass")
    dumper.add_argument("--out", metavar="DIR", help="also write numbered files and per-pass diffs")
    dumper.add_argument("--source", action="store_true", help="annotate equations with source lines")
    dumper.add_argument("--dot", metavar="FILE", help="write the variable dataflow graph as DOT")
    dumper.add_argument("--svg", metavar="FILE", help="draw the dataflow graph as SVG (needs Graphviz)")
    dumper.add_argument("--png", metavar="FILE", help="draw the dataflow graph as PNG (needs Graphviz)")
    dumper.add_argument("--mutable", action="append", default=[], metavar="COLLECTION",
                        help="a collection the call may write, e.g. batch_stats (repeatable)")
    summarizer = command("summary", "table of the variables per module and collection")
    summarizer.add_argument("--detail", action="store_true", help="one line per variable")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        shapes = [parse_shape(spec)[1] for spec in args.shape]
        target = load_target(args.target)
    except (ValueError, argparse.ArgumentTypeError) as e:
        parser.error(str(e))
    import jax
    import jax.numpy as jnp

    from varjax.ir.errors import VarjaxError
    from varjax.tools.model_summary import summary

    inputs = [jnp.zeros(s.shape, s.dtype) for s in shapes]
    keys = jax.random.split(jax.random.key(0), len(args.rng) + 1)
    rngs = dict(zip(["params", *args.rng], keys))
    try:
        if args.command == "summary":
            print(summary(target, *inputs, rngs=rngs).table(detail=args.detail))
            return 0
        return _dump(parser, args, target, inputs, rngs)
    except VarjaxError as e:
        print(f"varjax: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


def _dump(parser: argparse.ArgumentParser, args: argparse.Namespace, target: Any,
          inputs: list[Any], rngs: dict[str, Any]) -> int:
    from varjax.nn.module import DEFAULT_INIT_MUTABLE
    from varjax.tools.dataflow import dataflow
    from varjax.tools.ir_dump import dump
    from varjax.tools.target import as_functionalized

    variables = as_functionalized(target).init(rngs, *inputs, mutable=DEFAULT_INIT_MUTABLE)
    mutable = args.mutable or False
    out = Path(args.out) if args.out is not None else None
    before = set(out.iterdir()) if out is not None and out.is_dir() else set()
    entries = dump(target, *inputs, variables=variables, rngs=rngs, mutable=mutable,
                   to=args.out, source=args.source)
    if args.after is not None:
        texts = dict(entries)
        if args.after not in texts:
            parser.error(f"unknown pass {args.after!r} for --after; the passes are: "
                         f"{', '.join(name for name, _ in entries)}")
        print(texts[args.after])
    else:
        # A pass that changed nothing prints only its header line: the IR is the one above.
        print("\n".join(text if "(unchanged)" not in text.split("\n", 1)[0] else text.split("\n", 1)[0]
                        for _, text in entries))
    if out is not None:
        for run_dir in sorted(set(out.iterdir()) - before):
            _wrote(run_dir)
    pictures = [(p, fmt) for p, fmt in ((args.dot, "dot"), (args.svg, "svg"), (args.png, "png"))
                if p is not None]
    if pictures:
        graph = dataflow(target, *inputs, variables=variables, rngs=rngs, mutable=mutable)
        for path, fmt in pictures:
            _wrote(graph.render(path, format=fmt))
    return 0


def _wrote(path: str | os.PathLike) -> None:
    """One line naming a file (or folder) the command wrote, relative to the current folder."""
    print(f"wrote {os.path.relpath(path)}")

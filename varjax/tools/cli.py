"""``python -m varjax``: dump the IR or summarize the variables of code in a file.

    python -m varjax dump model.py:loss --shape x=f32[8,256] --after discharge
    python -m varjax dump model.py:loss --shape x=f32[8,256] --out dumps/ --dot flow.dot
    python -m varjax dump model.py:loss --shape x=f32[8,256] --svg flow.svg --png flow.png
    python -m varjax summary model.py:MLP --shape x=f32[8,256] --detail
    python -m varjax dump model.py:MLP --shape x=f32[8,256] --kw train=true --rng dropout \
        --mutable batch_stats --after discharge

``FILE:NAME`` loads the file as a module and takes its attribute ``NAME``: a function, a
``vj.functionalize``-d function, a Module class (built with no arguments) or a partial of one,
a Module instance, a function over a module (its first parameter, annotated with the
module's class), or a ``functools.partial`` of any of these (``varjax.tools.cli_target``).
Each ``--shape`` adds one positional argument of zeros, each ``--kw NAME=VALUE`` one keyword
argument, its value a Python literal (``true``/``false``/``none`` too; anything else is a
string). ``dump`` initializes the variables with key 0 and then shows the effectful IR and the
IR after every pass; the pure IR's header names its inputs. Each file or folder it
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
import ast
import os
import re
import sys
import textwrap
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


_WORDS = {"true": True, "false": False, "none": None}


def parse_keyword(spec: str) -> tuple[str, Any]:
    """``"train=true"`` -> ``("train", True)``: ``--kw``'s argparse type.  The value is a
    Python literal (``3``, ``0.5``, ``'a'``, ``(2, 3)``), or ``true``/``false``/``none`` in any
    case, as a shell user writes them; anything else is the string itself (``mode=fast``)."""
    name, sep, text = spec.partition("=")
    name = name.strip()
    if not sep or not name.isidentifier():
        raise argparse.ArgumentTypeError(
            f"bad keyword argument {spec!r}: expected NAME=VALUE, e.g. train=true or rate=0.5")
    text = text.strip()
    if text.lower() in _WORDS:
        return name, _WORDS[text.lower()]
    try:
        return name, ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return name, text


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m varjax", description="Inspect stateful JAX code traced by varjax.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help, description=help)
        sub.add_argument("target", metavar="FILE:NAME",
                         help="a function, functionalized function, Module class or instance, "
                              "function over a module, or a partial of one")
        sub.add_argument("--shape", type=_check_shape, action="append", default=[],
                         metavar="NAME=DTYPE[DIMS]",
                         help="one positional argument of zeros, e.g. x=f32[8,256]; repeat in "
                              f"argument order; dtypes: {', '.join(DTYPES)}")
        sub.add_argument("--kw", type=parse_keyword, action="append", default=[],
                         metavar="NAME=VALUE",
                         help="one keyword argument of the call, e.g. train=true; the value is "
                              "a Python literal, true/false/none, or else a string (repeatable)")
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
    keywords = [name for name, _ in args.kw]
    repeated = sorted({name for name in keywords if keywords.count(name) > 1})
    if repeated:
        parser.error(f"--kw {', '.join(repeated)} given more than once")
    from varjax.ir.errors import UnboundModuleError, VarjaxError
    from varjax.tools.cli_target import check_call, load_target

    try:
        shapes = [parse_shape(spec) for spec in args.shape]
        target = load_target(args.target)
        check_call(target, args.target, shapes, dict(args.kw))
    except (ValueError, argparse.ArgumentTypeError) as e:
        parser.error(str(e))
    except VarjaxError as e:
        return _report(e)
    import jax
    import jax.numpy as jnp

    from varjax.functionalization.functionalized import function_name
    from varjax.tools.model_summary import summary
    from varjax.tools.target import is_linen_target

    inputs = [(name, jnp.zeros(s.shape, s.dtype)) for name, s in shapes]
    keys = jax.random.split(jax.random.key(0), len(args.rng) + 1)
    rngs = dict(zip(["params", *args.rng], keys))
    kwargs = dict(args.kw)
    try:
        if args.command == "summary":
            arrays = [array for _, array in inputs]
            print(summary(target, *arrays, rngs=rngs, **kwargs).table(detail=args.detail))
            return 0
        return _dump(parser, args, target, inputs, kwargs, rngs)
    except UnboundModuleError as e:
        if is_linen_target(target):
            return _report(e)
        # The function built a module and called it: the command line cannot reach it.
        fn, module = function_name(target), (e.module or "Model").split()[0]
        return _report(e, "python -m varjax: to reach a module from a function, take it as the "
                          f"function's first parameter,\nannotated with its class (def {fn}("
                          f"model: {module}, ...)), or name functools.partial({fn}, {module}(...))"
                          "\nin the file; see notes/inspecting.md, \"The command line\"")
    except VarjaxError as e:
        return _report(e)


def _report(error: Exception, hint: str | None = None) -> int:
    """Exit status 1: varjax's message, which names the variable and the user's line, without
    a traceback."""
    print(f"varjax: {type(error).__name__}: {error}", file=sys.stderr)
    if hint is not None:
        print(hint, file=sys.stderr)
    return 1


def _dump(parser: argparse.ArgumentParser, args: argparse.Namespace, target: Any,
          inputs: list[tuple[str, Any]], kwargs: dict[str, Any], rngs: dict[str, Any]) -> int:
    from varjax.nn.module import DEFAULT_INIT_MUTABLE
    from varjax.tools.dataflow import dataflow
    from varjax.tools.ir_dump import dump
    from varjax.tools.target import as_functionalized

    fn = as_functionalized(target)
    arrays = [array for _, array in inputs]
    variables = fn.init(rngs, *arrays, mutable=DEFAULT_INIT_MUTABLE, **kwargs)
    mutable = args.mutable or False
    out = Path(args.out) if args.out is not None else None
    before = set(out.iterdir()) if out is not None and out.is_dir() else set()
    entries = dump(target, *arrays, variables=variables, rngs=rngs, mutable=mutable,
                   to=args.out, source=args.source, **kwargs)
    signature = fn.traced(*arrays, variables=variables, rngs=rngs, mutable=mutable,
                          **kwargs).signature
    pure_name, pure_text = entries[-1]
    entries[-1] = pure_name, name_inputs(pure_text, signature, [name for name, _ in inputs])
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
        graph = dataflow(target, *arrays, variables=variables, rngs=rngs, mutable=mutable,
                         **kwargs)
        for path, fmt in pictures:
            _wrote(graph.render(path, format=fmt))
    return 0


def _wrote(path: str | os.PathLike) -> None:
    """One line naming a file (or folder) the command wrote, relative to the current folder."""
    print(f"wrote {os.path.relpath(path)}")


def name_inputs(text: str, signature: Any, arguments: list[str]) -> str:
    """The pure IR's text with a line after its header naming each input: the printed
    jaxpr calls them ``a b c ...``; the discharge signature says which variable each is
    (``params/Dense_0/kernel``, ``rngs/dropout`` for a stream's key), and the call's arguments
    come last, named as ``--shape`` named them."""
    from varjax.ir.streams import KEYS

    names = []
    for (collection, path), leaves in signature.inputs:
        name = "/".join(("rngs" if collection == KEYS else collection, *path))
        n = len(leaves.avals)
        names.extend([name] if n == 1 else [f"{name}[{i}]" for i in range(n)])
    names.extend(arguments)
    header, body = text.split("\n", 1)
    lines = body.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("{ lambda"))
    binders = " ".join(lines[start:]).split(". let", 1)[0].split(";", 1)[1].split()
    pairs = [f"{binder.split(':', 1)[0]}={name}"
             for binder, name in zip(binders, names, strict=True)]
    named = textwrap.wrap(" ".join(pairs), width=100, initial_indent="// inputs: ",
                          subsequent_indent="//   ", break_long_words=False,
                          break_on_hyphens=False)
    return "\n".join([header, *named, body])


"""``varjax.functional`` is pure layer math: of varjax it imports ``varjax.ir.errors`` and the
annotation vocabulary ``varjax.ir.typing`` (which imports nothing of varjax) only, so neither
frontend's machinery (tracing, modules, transforms) can leak into it, and both frontends
(``varjax.nn``, ``varjax.nnx``) import it.  ``tests/test_layering.py`` allows the
whole IR layer; this test holds the package to the narrower promise."""
import ast
from pathlib import Path

import varjax.functional
import varjax.nn.linear

FOLDER = Path(varjax.functional.__file__).parent


def _imported(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = "varjax.functional" if node.level else node.module
            found.update(f"{base}.{a.name}" for a in node.names)   # ``from varjax.ir import errors``
    return found


def _allowed(name: str) -> bool:
    return (not name.startswith("varjax.") or name.startswith("varjax.functional.")
            or name.split(".")[:3] in (["varjax", "ir", "errors"], ["varjax", "ir", "typing"]))


def test_functional_imports_of_varjax_only_itself_ir_errors_and_ir_typing():
    outside = {(path.name, name) for path in sorted(FOLDER.glob("*.py")) for name in _imported(path)
               if not _allowed(name)}
    assert outside == set()
    assert not _allowed("varjax.trace.context") and not _allowed("varjax._jax.core")
    assert not _allowed("varjax.ir.primitives") and _allowed("varjax.ir.typing.Dtype")


def test_nn_layers_compute_with_the_functional_math():
    assert varjax.nn.linear.F is varjax.functional
    assert varjax.nn.max_pool is varjax.functional.max_pool
    assert varjax.nn.initializers.lecun_normal is varjax.functional.initializers.lecun_normal

"""``import varjax`` imports its API on first use, so ``python -m varjax --help`` and usage
errors answer without importing JAX (a second or more); the lazy API is the eager one."""
import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import varjax
import varjax.transforms

INIT = Path(varjax.__file__)


def python(code: str, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *flags, "-c", textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=120)


def test_help_and_usage_errors_do_not_import_jax():
    done = python("""
        import sys
        from varjax.tools.cli import main
        for argv, status in ((["--help"], 0), (["dump", "--help"], 0), (["dump"], 2),
                             (["summary", "m.py:f", "--shape", "x=f33[2]"], 2)):
            try:
                main(argv)
            except SystemExit as e:
                assert e.code == status, (argv, e.code)
        assert "jax" not in sys.modules, "jax was imported"
        print("no jax")
    """)
    assert done.returncode == 0, done.stderr
    assert "usage: python -m varjax" in done.stdout and done.stdout.endswith("no jax\n")
    assert "unknown dtype 'f33'" in done.stderr


def test_python_m_varjax_help_imports_no_jax_module():
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "varjax", "--help"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "dump" in done.stdout
    imported = [line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines()]
    assert "varjax.tools.cli" in imported and not [m for m in imported if m.split(".")[0] == "jax"]


def test_moved_modules_load_at_their_old_import_paths():
    done = python("""
        import varjax.errors, varjax.primitives
        from varjax.passes.lora import merge
        from varjax.lifting import lift
        import varjax as vj
        assert varjax.errors is varjax.ir.errors and varjax.primitives is varjax.ir.primitives
        assert merge is varjax.passes.library.lora.merge and lift is vj.lift
        print("ok")
    """)
    assert done.returncode == 0 and done.stdout == "ok\n", done.stderr


def test_dir_of_varjax_is_its_api_and_dunders():
    done = python("""
        import varjax as vj
        import varjax.nn
        vj.functionalize                        # loads the API: submodules bind on the package
        names = dir(vj)
        assert [n for n in names if not n.startswith("__")] == sorted(vj.__all__), names
        assert "__doc__" in names and "sys" not in names and "ir" not in names
        print("ok")
    """)
    assert done.returncode == 0 and done.stdout == "ok\n", done.stderr


def test_type_checking_imports_match_the_lazy_table():
    tree = ast.parse(INIT.read_text())
    (block,) = [node for node in tree.body if isinstance(node, ast.If)
                and getattr(node.test, "id", "") == "TYPE_CHECKING"]
    spelled = {}
    for node in block.body:
        assert isinstance(node, ast.ImportFrom), ast.unparse(node)
        for alias in node.names:
            assert alias.asname == alias.name, ast.unparse(node)   # an explicit re-export
            submodule = alias.name in varjax._SUBMODULES
            spelled[alias.name] = f"{node.module}.{alias.name}" if submodule else node.module
    assert spelled == varjax._API
    assert set(varjax.transforms.__all__) <= set(varjax.__all__)


def test_public_names_are_the_objects_even_when_a_submodule_was_imported_first():
    done = python("""
        import sys
        from varjax.passes import REGISTRY         # its modules import varjax.ir.errors
        import varjax.nn, varjax.functionalization.functionalized
        import varjax as vj
        assert vj.functionalize is sys.modules["varjax.functionalization.functionalized"].functionalize
        assert vj.errors is sys.modules["varjax.ir.errors"] and vj.vmap.__module__.startswith("varjax")
        namespace = {}
        exec("from varjax import *", namespace)
        assert namespace["Rngs"] is vj.Rngs and "dataflow" in dir(vj)
        try:
            vj.no_such_name
        except AttributeError as e:
            assert "no attribute 'no_such_name'" in str(e)
        else:
            raise AssertionError("no AttributeError")
        print("ok")
    """)
    assert done.returncode == 0 and done.stdout == "ok\n", done.stderr

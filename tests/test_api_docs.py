"""The API reference (``make docs``) builds without a pdoc warning and covers every public
name of ``varjax``, ``varjax.nn`` and ``varjax.passes``."""
from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("pdoc")

_BUILD = Path(__file__).resolve().parents[1] / "docs" / "build.py"


def _load_build():
    spec = importlib.util.spec_from_file_location("varjax_docs_build", _BUILD)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    build = _load_build()
    out = tmp_path_factory.mktemp("api")
    caught = build.build(out)
    return build, out, caught


def test_builds_without_warnings(docs):
    _, out, caught = docs
    assert [str(w.message) for w in caught] == []
    assert (out / "index.html").is_file() and (out / "search.js").is_file()


def test_every_public_name_is_documented(docs):
    build, out, _ = docs
    pages = build.public_modules()
    assert {"varjax", "varjax.nn", "varjax.passes", "varjax.ir.errors"} <= pages.keys()
    missing = []
    for module, names in pages.items():
        html = (out / f"{module.replace('.', '/')}.html").read_text()
        for name in names:
            value = getattr(sys.modules[module], name)
            if isinstance(value, type(sys)):       # an exported module: linked, with its own page
                found = f'{value.__name__.replace(".", "/")}.html' in html or \
                    f'{value.__name__.rpartition(".")[2]}.html' in html
            else:
                found = f'id="{name}"' in html
            if not found:
                missing.append(f"{module}.{name}")
    assert missing == []
    # The explicit re-exports of varjax/__init__.py are the API (it has no __all__).
    assert {"functionalize", "param", "pretty", "vmap", "errors"} <= set(pages["varjax"])
    assert {"Dense", "Module", "relu", "scan"} <= set(pages["varjax.nn"])
    assert "_jax" not in pages["varjax"] and "scope" not in pages["varjax"]


def test_a_bad_annotation_is_reported(tmp_path, monkeypatch):
    """The check has teeth: pdoc's warning about a package's own object comes back."""
    (tmp_path / "vjdocprobe.py").write_text(textwrap.dedent('''\
        from __future__ import annotations


        def f(x: NoSuchType) -> None:
            """Documented."""
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    caught = _load_build().build(tmp_path / "out", roots=("vjdocprobe",))
    assert any("NoSuchType" in str(w.message) for w in caught)

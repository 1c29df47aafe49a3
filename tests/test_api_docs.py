"""The API reference (``make docs``) builds without a pdoc warning, covers every public
name of ``varjax``, ``varjax.nn``, ``varjax.passes`` and ``varjax.nnx``, documents each, and
starts where a user starts.  One build (a few seconds) serves every test."""
from __future__ import annotations

import importlib.util
import re
import sys
import textwrap
import typing
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
    assert {"varjax", "varjax.nn", "varjax.passes", "varjax.nnx", "varjax.ir.errors"} <= pages.keys()
    missing = []
    for module, names in pages.items():
        html = (out / f"{module.replace('.', '/')}.html").read_text()
        for name in names:
            value = getattr(sys.modules[module], name)
            if isinstance(value, type(sys)):       # an exported module: linked, with its own page
                found = f'href="{"../" * module.count(".")}{value.__name__.replace(".", "/")}.html"' \
                    in html or f'{value.__name__.rpartition(".")[2]}.html' in html
            elif isinstance(value, typing.TypeVar):     # a type parameter: pdoc lists none
                found = True
            else:
                found = f'id="{name}"' in html
            if not found:
                missing.append(f"{module}.{name}")
    assert missing == []
    # The explicit re-exports of varjax/__init__.py are the API (it has no __all__).
    assert {"functionalize", "param", "pretty", "vmap", "errors"} <= set(pages["varjax"])
    assert {"Dense", "Module", "relu", "scan"} <= set(pages["varjax.nn"])
    assert "_jax" not in pages["varjax"] and "scope" not in pages["varjax"]


def test_every_public_callable_and_layer_field_has_a_docstring(docs):
    build, _, _ = docs
    assert build.undocumented() == []


def test_the_landing_page_starts_with_tasks_and_links_the_apis(docs):
    _, out, _ = docs
    assert "url=./varjax.html" in (out / "index.html").read_text()
    html = (out / "varjax.html").read_text()
    overview = html[html.index('<div class="docstring">'):html.index('<section id="PARTITION_NAME">')]
    for page in ("varjax/nn.html", "varjax/nnx.html", "varjax/passes.html", "varjax/ir/errors.html"):
        assert f'href="{page}"' in overview
    assert "Port a Flax Linen model" in overview and "Train with objects" in overview
    assert "PEP 562" not in overview and "_API" not in overview


def test_signatures_show_public_names(docs):
    """No ``@errors.api_boundary`` (a traceback filter, not the API), no ``jax._src`` path,
    and a wrapped function's own parameters."""
    _, out, _ = docs
    pages = {p: p.read_text() for p in out.rglob("*.html")}
    assert [p.name for p, html in pages.items()
            if "decorator-errors.api_boundary" in html or "decorator-api_boundary" in html] == []
    assert [p.name for p, html in pages.items()
            if re.search(r"jax\._src\.|jax\.jaxlib\._jax\.", html)] == []
    nn_page = (out / "varjax" / "nn.html").read_text()
    assert "jax.lax.Precision" in nn_page and "jax.sharding.Mesh" in nn_page
    relu = nn_page.split('<section id="relu">')[1].split("</section>")[0]
    assert 'class="docstring"' in relu           # JAX's docstring, shown for its custom_jvp
    functionalize = (out / "varjax.html").read_text().split('<section id="functionalize">')[1]
    functionalize = functionalize.split("</section>")[0]
    assert "dump_dir" in functionalize and "decorator" not in functionalize


def test_an_undocumented_name_is_reported(tmp_path, monkeypatch):
    """The coverage check has teeth: a bare function, a partial of one, a dataclass's
    generated docstring and a layer's bare field are reported; documented ones are not."""
    (tmp_path / "vjdocprobe2.py").write_text(textwrap.dedent('''\
        import dataclasses
        import functools

        import varjax.nn as nn


        def bare(x): return x


        def told(x):
            """Documented."""


        bare_partial = functools.partial(bare, 1)
        told_partial = functools.partial(told, 1)


        @dataclasses.dataclass
        class Generated:
            x: int


        class Layer(nn.Module):
            """A layer."""
            shown: int = 1
            """Documented."""
            hidden: int = 2
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    missing = _load_build().undocumented(roots=("vjdocprobe2",))
    assert {"vjdocprobe2.bare", "vjdocprobe2.bare_partial", "vjdocprobe2.Generated",
            "vjdocprobe2.Layer.hidden"} <= set(missing)
    assert not {"vjdocprobe2.told", "vjdocprobe2.told_partial", "vjdocprobe2.Layer",
                "vjdocprobe2.Layer.shown"} & set(missing)


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


def test_public_signatures_say_what_they_take_not_bare_any(docs):
    """Issue 38: a parameter's annotation is the reference's word on what to pass.  A bare
    ``Any`` says nothing; ``vj.typing`` names the kinds (``PyTree``, ``Dtype``,
    ``CollectionFilter``, ``Passes``, ...)."""
    build, _, _ = docs
    assert build.bare_any() == []

"""Test configuration that makes silent bugs loud.

Strict dtype promotion and rank-promotion errors catch accidental upcasts and
broadcasts in rewritten jaxprs; two host devices let sharding tests run on CPU.
"""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

os.environ.setdefault("VARJAX_VERIFY", "1")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture
def report(request):
    """``report(line)`` writes ``line`` to the terminal even while output is captured: the
    fuzz tests say how many examples they checked."""
    def write(line: str) -> None:
        reporter = request.config.pluginmanager.get_plugin("terminalreporter")
        capture = request.config.pluginmanager.get_plugin("capturemanager")
        if reporter is None or capture is None:
            print(line)
            return
        with capture.global_and_fixture_disabled():
            reporter.ensure_newline()
            reporter.write_line(line)
    return write


@pytest.fixture(autouse=True)
def _pass_registry_restored():
    """A pass class a test defines registers its name process-wide; without this, a later
    test (on the same xdist worker) that defines another class of that name gets "already
    registered by a different class" -- which test runs first depends on scheduling."""
    from varjax.passes import REGISTRY
    saved = dict(REGISTRY)
    yield
    REGISTRY.clear()
    REGISTRY.update(saved)

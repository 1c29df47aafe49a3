"""``nnx.set_graph_mode``/``set_graph_updates``: a call, a ``with`` block, a decorator, and
the environment default, behaving as flax.nnx's."""
import subprocess
import sys

import flax.nnx
import pytest

from varjax import errors
from varjax.nnx.config import resolve, set_graph_mode, set_graph_updates


@pytest.mark.parametrize("lib", ["flax", "varjax"])
def test_call_with_block_and_decorator_set_and_restore_as_flax(lib):
    setting = flax.nnx.set_graph_mode if lib == "flax" else set_graph_mode
    seen = [setting.current_value()]
    with setting(False):
        seen.append(setting.current_value())
        with setting(True):
            seen.append(setting.current_value())
        seen.append(setting.current_value())
    seen.append(setting.current_value())

    @setting(False)
    def inside():
        return setting.current_value()
    seen += [setting.current_value(), inside(), setting.current_value()]
    setting(False)
    seen.append(setting.current_value())
    setting(True)
    seen.append(setting.current_value())
    assert seen == [True, False, True, False, True, True, False, True, False, True]


def test_graph_updates_need_graph_mode_and_none_means_the_current_value():
    assert resolve(None, None) == (True, True)
    assert resolve(False, True) == (False, False)
    with set_graph_updates(False):
        assert resolve(None) == (True, False)
        assert resolve(True, True) == (True, True)


def test_a_non_bool_setting_is_an_error():
    with pytest.raises(errors.TransformError, match="True or False"):
        set_graph_mode("no")


def test_environment_variables_set_the_process_default():
    code = ("from varjax.nnx.config import set_graph_mode, set_graph_updates;"
            "print(set_graph_mode.current_value(), set_graph_updates.current_value())")
    env = {"NNX_GRAPH_MODE": "false", "NNX_GRAPH_UPDATES": "0", "JAX_PLATFORMS": "cpu",
           "PATH": ""}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_an_environment_value_that_is_not_a_boolean_is_an_error_naming_it(monkeypatch):
    from varjax.nnx import config
    monkeypatch.setattr(config._STACKS, "graph", [])   # no value set: the default is read
    monkeypatch.setenv("NNX_GRAPH_MODE", "maybe")
    with pytest.raises(errors.TransformError, match="NNX_GRAPH_MODE='maybe' is not a boolean"):
        set_graph_mode.current_value()

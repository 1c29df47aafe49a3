"""``varjax.tools.model_summary``: variables per module and collection, from abstract traces."""
import jax
import jax.numpy as jnp

import varjax as vj
import varjax.nn as nn
from varjax.tools.model_summary import Totals, format_bytes, summary


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Dense(32)(x)
        x = nn.BatchNorm(use_running_average=not train)(x)
        return nn.Dense(4)(nn.relu(x))


class Tower(nn.Module):
    """Submodules called in an order unlike their names: Dense_1 runs first."""

    @nn.compact
    def __call__(self, x):
        outer, inner = nn.Dense(3), nn.Dense(2)
        self.variable("stats", "calls", jnp.zeros, (), jnp.int32)   # created, never read
        return outer(inner(x))


def test_mlp_table_counts_bytes_and_totals():
    s = summary(MLP(), jax.ShapeDtypeStruct((8, 256), jnp.float32))
    assert s.modules == ["", "Dense_0", "BatchNorm_0", "Dense_1"]   # call order, root first
    assert s.totals("Dense_0") == {"params": Totals(2, 256 * 32 + 32, (256 * 32 + 32) * 4)}
    assert s.totals("BatchNorm_0") == {"params": Totals(2, 64, 256), "batch_stats": Totals(2, 64, 256)}
    assert s.totals() == {"params": Totals(6, 8420, 33680), "batch_stats": Totals(2, 64, 256)}
    assert str(s) == s.table() == """\
module      | params                    | batch_stats
------------+---------------------------+---------------------
MLP (root)  |                           |
Dense_0     | 2 arrays, 8,224 (32.1 KB) |
BatchNorm_0 | 2 arrays, 64 (256 B)      | 2 arrays, 64 (256 B)
Dense_1     | 2 arrays, 132 (528 B)     |
------------+---------------------------+---------------------
total       | 6 arrays, 8,420 (32.9 KB) | 2 arrays, 64 (256 B)"""


def test_detail_rows_and_access_from_the_ir():
    s = summary(MLP(), jnp.ones((8, 256), jnp.bfloat16), train=True)
    stats = [r for r in s.rows if r.collection == "batch_stats"]
    assert [(r.module, r.name, r.shape, r.access) for r in stats] == [
        ("BatchNorm_0", "mean", (32,), "read/write"), ("BatchNorm_0", "var", (32,), "read/write")]
    # A static argument picks the traced path: inference reads the statistics only.
    assert {r.access for r in summary(MLP(), jnp.ones((8, 256)), train=False).rows} == {"read"}
    table = s.table(detail=True).splitlines()
    assert table[0].split(" | ") == ["module     ", "collection ", "name  ", "shape   ", "dtype  ",
                                     "count", "  bytes", "access"]
    kernel = "Dense_0 | params | kernel | [256,32] | float32 | 8,192 | 32.0 KB | read"
    assert table[2].split() == kernel.split()
    assert table[-1].split() == ["total", "|", "|", "|", "|", "|", "8,484", "|", "33.1", "KB", "|"]


def test_submodules_follow_the_call_and_unused_variables_are_marked():
    s = summary(Tower(), jnp.ones((2, 3)))
    assert s.modules == ["", "Dense_1", "Dense_0"]
    calls = [r for r in s.rows if r.collection == "stats"]
    assert [(r.module, r.path, r.access) for r in calls] == [("", ("calls",), "unused")]


def test_function_variables_live_in_the_root_module():
    def layer(x):
        w = vj.param("w", jax.nn.initializers.ones, (x.shape[-1], 2))
        pair = vj.variable("stats", "pair", lambda: (jnp.zeros(2), jnp.zeros((), jnp.int32)))
        pair.value = (pair.value[0] + 1, pair.value[1])
        vj.sow("intermediates", "h", x)   # sown values are not variables of the model
        return x @ w

    s = summary(layer, jnp.ones((4, 3)))
    assert s.modules == [""]
    assert [(r.module, r.collection, r.name, r.dtype, r.count, r.bytes, r.access) for r in s.rows] == [
        ("", "params", "w", jnp.float32, 6, 24, "read"),
        ("", "stats", "pair[0]", jnp.float32, 2, 8, "read/write"),
        ("", "stats", "pair[1]", jnp.int32, 1, 4, "read/write")]
    assert s.table().splitlines()[2] == "layer (root) | 1 array, 6 (24 B) | 2 arrays, 3 (12 B)"


def test_format_bytes():
    assert [format_bytes(n) for n in (0, 1023, 1024, 4224, 3 * 2**20, 5 * 2**30)] == [
        "0 B", "1023 B", "1.0 KB", "4.1 KB", "3.0 MB", "5.0 GB"]

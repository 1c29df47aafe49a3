"""Pure layer math shared by both frontends: functions of arrays (and keys), no variables.

``varjax.nn`` (Linen) and ``varjax.nnx`` declare their parameters and call into this
package for the arithmetic, so neither copies the other's math and a layer of one gives
the other's numbers for the same parameters.  It imports JAX and ``varjax.ir.errors``
only: nothing here reads or writes a variable, draws from a stream or knows a module.

One file per topic; every public function is also a name of this package
(``from varjax import functional as F``; ``F.dense(x, kernel, bias)``).
"""
from varjax.functional.conv import canonicalize_padding as canonicalize_padding
from varjax.functional.conv import conv as conv
from varjax.functional.conv import conv_kernel_shape as conv_kernel_shape
from varjax.functional.conv import conv_local as conv_local
from varjax.functional.conv import conv_local_shapes as conv_local_shapes
from varjax.functional.conv import conv_transpose as conv_transpose
from varjax.functional.dtypes import canonicalize_dtype as canonicalize_dtype
from varjax.functional.dtypes import cast as cast
from varjax.functional.dtypes import promote_dtype as promote_dtype
from varjax.functional.embedding import attend as attend
from varjax.functional.embedding import embed as embed
from varjax.functional.linear import add_bias as add_bias
from varjax.functional.linear import dense as dense
from varjax.functional.linear import dense_general as dense_general
from varjax.functional.linear import dense_general_axes as dense_general_axes
from varjax.functional.normalization import canonical_axes as canonical_axes
from varjax.functional.normalization import ema as ema
from varjax.functional.normalization import feature_shape as feature_shape
from varjax.functional.normalization import group_count as group_count
from varjax.functional.normalization import group_moments as group_moments
from varjax.functional.normalization import moments as moments
from varjax.functional.normalization import normalize as normalize

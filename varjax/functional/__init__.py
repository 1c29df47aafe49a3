"""Pure layer math shared by both frontends: functions of arrays (and keys), no variables.

``varjax.nn`` (Linen) and ``varjax.nnx`` declare their parameters and call into this
package for the arithmetic, so neither copies the other's math and a layer of one gives
the other's numbers for the same parameters.  It imports JAX and ``varjax.ir.errors``
only: nothing here reads or writes a variable, draws from a stream or knows a module.

One file per topic; every public function is also a name of this package
(``from varjax import functional as F``; ``F.dense(x, kernel, bias)``).
"""
from varjax.functional.activations import prelu as prelu
from varjax.functional.attention import combine_masks as combine_masks
from varjax.functional.attention import decode_cache_update as decode_cache_update
from varjax.functional.attention import dot_product_attention as dot_product_attention
from varjax.functional.attention import dot_product_attention_weights as dot_product_attention_weights
from varjax.functional.attention import make_attention_mask as make_attention_mask
from varjax.functional.attention import make_causal_mask as make_causal_mask
from varjax.functional.contraction import einsum as einsum
from varjax.functional.contraction import einsum_bias_shape as einsum_bias_shape
from varjax.functional.convolution import canonicalize_padding as canonicalize_padding
from varjax.functional.convolution import conv as conv
from varjax.functional.convolution import conv_kernel_shape as conv_kernel_shape
from varjax.functional.convolution import conv_local as conv_local
from varjax.functional.convolution import conv_local_shapes as conv_local_shapes
from varjax.functional.convolution import conv_transpose as conv_transpose
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
from varjax.functional.pooling import avg_pool as avg_pool
from varjax.functional.pooling import max_pool as max_pool
from varjax.functional.pooling import min_pool as min_pool
from varjax.functional.pooling import pool as pool
from varjax.functional.recurrent import fused_dense as fused_dense
from varjax.functional.recurrent import gru_step as gru_step
from varjax.functional.recurrent import lstm_step as lstm_step
from varjax.functional.recurrent import mgu_step as mgu_step
from varjax.functional.recurrent import simple_step as simple_step
from varjax.functional.stochastic import dropout as dropout
from varjax.functional.weight_normalization import l2_normalize as l2_normalize
from varjax.functional.weight_normalization import spectral_norm as spectral_norm
from varjax.functional.weight_normalization import weight_norm as weight_norm

"""Pure layer math shared by both frontends: functions of arrays (and keys), no variables.

``varjax.nn`` (Linen) and ``varjax.nnx`` declare their parameters and call into this
package for the arithmetic, so neither copies the other's math.  It imports JAX and
``varjax.ir.errors`` only."""

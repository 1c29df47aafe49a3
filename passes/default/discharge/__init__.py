"""discharge: functionalize variable effects, per collection.

After this pass the jaxpr is pure.  Reads become inputs, writes become outputs, through
every higher-order primitive; the top-level layout is ``ctx.results['signature']``, a
``Signature``.  One rule per primitive handles reads and writes together, and
collections a region does not touch never appear in its signature.

The package is a pass plus a rule registry, as JAX registers its own rules:

* ``discharger.py``: the environment, ``DischargeRule`` and ``register_discharge_rule``, the
  ``Discharger`` that re-traces a jaxpr dispatching to the rules, the binder-editing
  fast path (``discharge_flat``) and the ``Discharge`` pass;
* ``control_flow.py``: ``jit``, ``closed_call``, ``checkpoint``, ``scan``, ``while``,
  ``cond``;
* ``shard_map.py``: raw ``shard_map`` (and ``pmap``);
* ``custom.py``: raw ``custom_jvp`` / ``custom_vjp``; ``closures.py``: the values their
  rules close over, and guards on the rules of calls that are re-bound as they are.

Importing the package registers the built-in rules.  The rules get what they need
explicitly: user code (custom-derivative rules) re-enters the user's trace through
``PassContext.reenter``, never through an ambient trace context.

Sharp edges:
  * A variable that does not exist before a loop and is written inside it raises
    ``VariableCreationError``: the carry would have no initial value.
  * A variable created in only some branches of a raw ``lax.cond`` raises
    ``VariableCreationError`` naming the branches.
  * Custom rules are traced when JAX differentiates, after the functionalize trace
    ended.  A rule may close over values its function closes over (they are passed in);
    one it alone closes over raises ``TransformError``.
  * RNG draws inside a raw ``shard_map`` give every shard the same key.
"""
from varjax.passes.default.discharge import control_flow as control_flow  # registers its rules
from varjax.passes.default.discharge import custom as custom  # registers its rules
from varjax.passes.default.discharge import shard_map as shard_map  # registers its rule
from varjax.passes.default.discharge.discharger import RULES as RULES
from varjax.passes.default.discharge.discharger import Discharge as Discharge
from varjax.passes.default.discharge.discharger import Discharger as Discharger
from varjax.passes.default.discharge.discharger import DischargeRule as DischargeRule
from varjax.passes.default.discharge.discharger import Env as Env
from varjax.passes.default.discharge.discharger import Signature as Signature
from varjax.passes.default.discharge.discharger import discharge_flat as discharge_flat
from varjax.passes.default.discharge.discharger import register_discharge_rule as register_discharge_rule

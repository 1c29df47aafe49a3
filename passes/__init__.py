"""varjax.passes: the pass framework and every built-in pass.

Importing this package registers the built-in passes by name, so pipeline
strings such as ``"lower-rng,forward-stores,cast-params{dtype=bfloat16}"``
resolve.
"""
# Built-in passes (self-registering).
from varjax.passes.default.check_mutability import CheckMutability as CheckMutability
from varjax.passes.default.dead_reads import DeadReads as DeadReads
from varjax.passes.default.discharge import Discharge as Discharge
from varjax.passes.default.discharge import Signature as Signature
from varjax.passes.default.forward_stores import ForwardStores as ForwardStores
from varjax.passes.default.lower_rng import LowerRng as LowerRng
from varjax.passes.default.shard_variables import ShardVariables as ShardVariables
from varjax.passes.framework.analysis import Traffic as Traffic
from varjax.passes.framework.analysis import traffic as traffic
from varjax.passes.framework.base import REGISTRY as REGISTRY
from varjax.passes.framework.base import Pass as Pass
from varjax.passes.framework.base import PassContext as PassContext
from varjax.passes.framework.base import get_pass as get_pass
from varjax.passes.framework.dump import Dump as Dump
from varjax.passes.framework.dump import Recorder as Recorder
from varjax.passes.framework.instrument import DUMP_AFTER_ENV as DUMP_AFTER_ENV
from varjax.passes.framework.instrument import DUMP_CHANGED_ENV as DUMP_CHANGED_ENV
from varjax.passes.framework.instrument import DUMP_DIR_ENV as DUMP_DIR_ENV
from varjax.passes.framework.instrument import Instrumentation as Instrumentation
from varjax.passes.framework.instrument import Timing as Timing
from varjax.passes.framework.pipeline import Pipeline as Pipeline
from varjax.passes.framework.rewrite import Region as Region
from varjax.passes.framework.rewrite import Rewriter as Rewriter
from varjax.passes.framework.rewrite import Rule as Rule
from varjax.passes.framework.verify import Verify as Verify
from varjax.passes.framework.verify import verify as verify
from varjax.passes.library.cast_params import CastParams as CastParams
from varjax.passes.library.fake_quant import FakeQuant as FakeQuant
from varjax.passes.library.lora import Lora as Lora
from varjax.passes.library.stop_gradient import StopGradient as StopGradient
from varjax.passes.library.tie import Tie as Tie

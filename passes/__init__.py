"""varjax.passes: the pass framework and every built-in pass.

Importing this package registers the built-in passes by name, so pipeline
strings such as ``"lower-rng,forward-stores,cast-params{dtype=bfloat16}"``
resolve.
"""
from varjax.passes.analysis import Traffic as Traffic
from varjax.passes.analysis import traffic as traffic
from varjax.passes.base import REGISTRY as REGISTRY
from varjax.passes.base import Pass as Pass
from varjax.passes.base import PassContext as PassContext
from varjax.passes.base import get_pass as get_pass
from varjax.passes.cast_params import CastParams as CastParams

# Built-in passes (self-registering).
from varjax.passes.check_mutability import CheckMutability as CheckMutability
from varjax.passes.dead_reads import DeadReads as DeadReads
from varjax.passes.discharge import Discharge as Discharge
from varjax.passes.discharge import Signature as Signature
from varjax.passes.dump import Dump as Dump
from varjax.passes.dump import Recorder as Recorder
from varjax.passes.fake_quant import FakeQuant as FakeQuant
from varjax.passes.forward_stores import ForwardStores as ForwardStores
from varjax.passes.instrument import DUMP_AFTER_ENV as DUMP_AFTER_ENV
from varjax.passes.instrument import DUMP_CHANGED_ENV as DUMP_CHANGED_ENV
from varjax.passes.instrument import DUMP_DIR_ENV as DUMP_DIR_ENV
from varjax.passes.instrument import Instrumentation as Instrumentation
from varjax.passes.instrument import Timing as Timing
from varjax.passes.lora import Lora as Lora
from varjax.passes.lower_rng import LowerRng as LowerRng
from varjax.passes.pipeline import Pipeline as Pipeline
from varjax.passes.rewrite import Region as Region
from varjax.passes.rewrite import Rewriter as Rewriter
from varjax.passes.rewrite import Rule as Rule
from varjax.passes.shard_variables import ShardVariables as ShardVariables
from varjax.passes.stop_gradient import StopGradient as StopGradient
from varjax.passes.tie import Tie as Tie
from varjax.passes.verify import Verify as Verify
from varjax.passes.verify import verify as verify

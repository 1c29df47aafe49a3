"""flax.nnx.nn.lora's names, each ``varjax.nnx``'s own object; ``__all__`` lists what
flax.nnx exports, and the default initializers are attributes too."""
from __future__ import annotations

from varjax.nnx.lora import LoRA, LoRALinear
from varjax.nnx.lora import default_a_initializer as default_a_initializer
from varjax.nnx.lora import default_b_initializer as default_b_initializer
from varjax.nnx.variablelib import LoRAParam

__all__ = ["LoRA", "LoRALinear", "LoRAParam"]

"""flax.nnx.nn.lora's names, each ``varjax.nnx``'s own object."""
from __future__ import annotations

from varjax.nnx.lora import LoRA, LoRALinear
from varjax.nnx.variablelib import LoRAParam

__all__ = ["LoRA", "LoRALinear", "LoRAParam"]

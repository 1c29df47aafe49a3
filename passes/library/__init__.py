"""The pass library: passes a user names in ``passes=`` (lora, tie, fake-quant,
cast-params, stop-gradient)."""

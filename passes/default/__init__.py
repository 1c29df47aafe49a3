"""The default pipeline: the passes every functionalize call runs (check-mutability,
lower-rng, forward-stores, dead-reads, shard-variables, discharge)."""

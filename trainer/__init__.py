"""Trainer: aggregation math, losses, micro-batching, CP sharding, backends, actors."""

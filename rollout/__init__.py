"""Rollout: datasets, grouped sampling, engines, rewards, advantages and the RolloutBatch."""

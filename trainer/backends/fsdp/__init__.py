"""torch FSDP2 backend: model.py (load, shard, state dicts), worker.py (the rank actor)."""

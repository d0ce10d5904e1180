"""Trainer backends side by side behind one interface: torch FSDP2 (default), Megatron."""

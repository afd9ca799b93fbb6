"""Scheduling and KV-cache bookkeeping in plain Python (no tensors)."""

"""Batch jobs: datasets of prompts mapped through kvserve replicas (``ray_data.py``)."""

"""Serving kvserve beyond one process: ``ray/`` runs engine replicas on Ray Serve."""

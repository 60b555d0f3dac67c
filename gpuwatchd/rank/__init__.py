"""Code that runs inside the training process: ``register_rank``/``heartbeat`` (api) and the CUDA-OOM hook.

Imports only the top-level value modules (model, units, ...); never the daemon, the sources or
prometheus_client (tests/test_layers.py enforces it).
"""

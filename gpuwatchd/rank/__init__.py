"""Code that runs inside the training process, all of it: ``register_rank``/``heartbeat`` (api), the
rank file it writes (rankfile, rankdir), the CUDA-OOM hook (cuda_oom), the flight-recorder responder
(flight_recorder), heartbeats with no code change (autobeat, and the wheel's .pth file that imports
it) and their launcher ``python -m gpuwatchd.rank.run train.py ARGS`` (run).

Imports only the top-level value modules (model, units, ...); never the daemon, the sources or
prometheus_client (tests/test_layers.py enforces it). This file imports nothing: the .pth file
loads it at every interpreter start-up where GPUWATCHD_HEARTBEAT is set.
"""

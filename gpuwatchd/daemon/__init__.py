"""The daemon: the cycle, its subsystems (GPU, kernel log, GIL sampler, memory, finding events),
isolation of the collectors, and the systemd notify protocol. See docs/architecture.md.
"""

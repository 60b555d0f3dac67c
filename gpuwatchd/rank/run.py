"""Launcher shim for heartbeats with no code change: ``python -m gpuwatchd.rank.run train.py ARGS``,
``python -m gpuwatchd.rank.run -m package.module ARGS``, or under torchrun ``torchrun ... -m
gpuwatchd.rank.run train.py ARGS``.

Installs the optimizer-step hook of rank/autobeat.py (register the rank at the first step,
then a heartbeat per step, at most once a second) and runs the script or module as ``__main__``
with ``sys.argv`` as it would have had (``runpy``, like ``python train.py``). Imports nothing but
the standard library's runpy before the script runs; never fails the job for lack of a daemon.
Cost and privilege: as rank/autobeat.py. Shell equivalent: ``GPUWATCHD_HEARTBEAT=1 python
train.py`` where the wheel (and its .pth file) is installed.
"""

from __future__ import annotations

import os
import runpy
import sys

from gpuwatchd.rank import autobeat

USAGE = "usage: python -m gpuwatchd.rank.run (SCRIPT | -m MODULE) [ARGS...]"


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help") or (args[0] == "-m" and len(args) < 2):
        print(USAGE, file=sys.stderr)
        raise SystemExit(2)
    autobeat.install()
    if args[0] == "-m":
        sys.argv = [args[1], *args[2:]]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = args
        sys.path[0] = os.path.dirname(os.path.abspath(args[0]))  # as python SCRIPT sets it
        runpy.run_path(args[0], run_name="__main__")


if __name__ == "__main__":
    main()

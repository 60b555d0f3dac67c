"""Benchmarks of gpuwatchd's budgets (bench/README.md maps each script to its budget).

Run each from the repository root as a module, ``.venv/bin/python -m bench.<script> ...``: the root
is then on sys.path, so ``gpuwatchd``, ``bench.benchlib`` and ``tests/`` helpers import without
any path edits.
"""

"""Heartbeats with no code change: register the rank and beat once per optimizer step.

Turned on for a job, not per script, in either of two ways:

- ``GPUWATCHD_HEARTBEAT=1`` in the ranks' environment, where the package is installed from its
  wheel: the wheel's ``gpuwatchd-heartbeat.pth`` runs at interpreter start-up and calls
  ``install()`` only when the variable is set (unset, empty or ``0``: nothing is imported);
- the launcher shim, ``python -m gpuwatchd.rank.run train.py ARGS`` or ``torchrun ... -m
  gpuwatchd.rank.run train.py ARGS`` (rank/run.py), which calls ``install()`` and runs the script
  as ``__main__``.

``install()`` imports nothing heavy and never torch: it puts a finder first on ``sys.meta_path``
that waits for ``torch.optim.optimizer`` to be imported (by the script, when it is), lets the real
loader run it, then registers one global hook with PyTorch's
``torch.optim.optimizer.register_optimizer_step_post_hook`` and steps aside. At the first optimizer
step the hook calls ``gpuwatchd.register_rank()`` (the rank layout from torchrun / Slurm / Open MPI
variables, rank directory ``GPUWATCH_RANK_DIR`` or /run/gpuwatch/ranks), then
``gpuwatchd.heartbeat(step)`` at every step, at most once per ``MIN_INTERVAL`` seconds (the
heartbeat's mtime only needs to be fresh against ``stall.after_seconds``, minutes). A job never
fails because of it: without a rank directory, daemon or launcher variables ``register_rank``
logs one warning and every later step costs one dictionary lookup; a torch without the global hook
(before 2.0) is left alone with a warning.

Cost: at start-up this module and its two packages (``gpuwatchd``, ``gpuwatchd.rank``: they
import nothing), nothing else: +1.2 ms CPU a ``python -c pass`` on an idle 2-CPU VM, 0.3 ms of it
the package ``gpuwatchd.rank`` (bench/results/pth_startup_rank_package_2cpu_vm.txt); one finder
call per import until torch.optim.optimizer is imported; then per optimizer step a clock read, and
once a second one 21-byte write in place (rank/api.py).
Privilege: the rank's own.
Shell equivalent: ``GPUWATCHD_HEARTBEAT=1 torchrun ... train.py``.
"""

import sys
import time

# Imported at every interpreter start-up where GPUWATCHD_HEARTBEAT is set (the wheel's .pth file):
# built-in modules only, no ``typing`` (5 ms) and no ``__future__`` (so annotations are strings),
# until torch.optim.optimizer is imported.
TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (mypy reads it by name)
if TYPE_CHECKING:
    from collections.abc import Sequence
    from types import ModuleType
    from typing import Any
TARGET = "torch.optim.optimizer"
MIN_INTERVAL = 1.0  # seconds between two heartbeat writes

_state: "dict[str, Any]" = {"installed": False, "registered": None, "step": 0, "last": float("-inf")}


def _beat(optimizer: object, args: object, kwargs: object) -> None:
    """The optimizer step post-hook: register at the first step, then beat."""
    from gpuwatchd.rank import api

    if _state["registered"] is None:
        _state["registered"] = api.register_rank() is not None
    if not _state["registered"]:
        return
    _state["step"] += 1
    now = time.monotonic()
    if now - _state["last"] >= MIN_INTERVAL:
        _state["last"] = now
        api.heartbeat(_state["step"])


def _hook(module: "ModuleType") -> None:
    register = getattr(module, "register_optimizer_step_post_hook", None)
    if register is None:
        import logging

        logging.getLogger(__name__).warning(
            "gpuwatchd: this torch has no register_optimizer_step_post_hook (torch >= 2.0): no "
            "automatic heartbeat; call gpuwatchd.heartbeat(step) in the training loop"
        )
        return
    register(_beat)


class _Loader:
    """Runs the real loader, then adds the hook to the module it made."""

    def __init__(self, real: "Any") -> None:
        self.real = real

    def create_module(self, spec: "Any") -> "Any":
        return self.real.create_module(spec)

    def exec_module(self, module: "ModuleType") -> None:
        self.real.exec_module(module)
        _hook(module)

    def __getattr__(self, name: str) -> "Any":  # get_code, get_source, is_package, ...
        return getattr(self.real, name)


class _Finder:
    """First on sys.meta_path until torch.optim.optimizer is found: only that name is touched."""

    def find_spec(self, name: str, path: "Sequence[str] | None" = None, target: "ModuleType | None" = None) -> "Any":
        if name != TARGET:
            return None
        _remove()
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader)
                return spec
        return None


def _remove() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Finder)]


def install() -> None:
    """Hook the optimizer steps of this process, now if torch.optim is loaded, else when it is."""
    if _state["installed"]:
        return
    _state["installed"] = True
    module = sys.modules.get(TARGET)
    if module is not None:
        _hook(module)
    else:
        sys.meta_path.insert(0, _Finder())

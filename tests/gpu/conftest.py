"""GPU suite: runs only where an NVIDIA driver is present; skipped (only) where none is.

Every test here is marked ``gpu``. The skip decision is NVML's own answer: ``nvmlInit`` raising
NVML_ERROR_LIBRARY_NOT_FOUND or NVML_ERROR_DRIVER_NOT_LOADED.
"""

from __future__ import annotations

import pytest


def _no_driver_reason() -> str | None:
    import pynvml

    try:
        pynvml.nvmlInit()
    except (pynvml.NVMLError_LibraryNotFound, pynvml.NVMLError_DriverNotLoaded) as exc:
        return f"no NVIDIA driver: {exc}"
    pynvml.nvmlShutdown()
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = None
    checked = False
    for item in items:
        if "/tests/gpu/" not in str(item.fspath).replace("\\", "/"):
            continue
        item.add_marker(pytest.mark.gpu)
        if not checked:
            reason, checked = _no_driver_reason(), True
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))

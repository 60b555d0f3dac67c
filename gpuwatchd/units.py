"""Human-readable units for explanations and CLI tables (binary prefixes, as nvidia-smi and
CUDA's OOM message use)."""

from __future__ import annotations


def fmt_bytes(n: float | None, none: str = "unknown") -> str:
    """``57_982_058_496`` -> ``"54.0 GiB"``; None -> ``none``."""
    if n is None:
        return none
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"

"""Human-readable units for explanations and CLI tables (binary prefixes, as nvidia-smi and
CUDA's OOM message use)."""

from __future__ import annotations

import re


def fmt_bytes(n: float | None, none: str = "unknown") -> str:
    """``57_982_058_496`` -> ``"54.0 GiB"``; None -> ``none``."""
    if n is None:
        return none
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


# PCI addresses as NVML, the kernel log and udev print them, reduced to one key (domain:bus:device)
_PCI = re.compile(
    r"(?:PCI:)?(?:(?P<domain>[0-9a-fA-F]{4,8}):)?(?P<bus>[0-9a-fA-F]{2}):(?P<dev>[0-9a-fA-F]{2})"
    r"(?:\.(?P<fn>[0-7]))?"
)


def normalize_pci_bus_id(text: str) -> str:
    """'00000000:3B:00.0', 'PCI:0000:3b:00', '3b:00.0' -> '0000:3b:00'; unknown text unchanged."""
    m = _PCI.search(text.strip())
    if m is None:
        return text.strip().lower()
    domain = (m.group("domain") or "0000")[-4:].lower()
    return f"{domain}:{m.group('bus').lower()}:{m.group('dev').lower()}"

"""Per-process evidence for the fork_after_cuda finding: NVIDIA device fds, executable, argv digest.

Reads ``/proc/PID/fd/*`` link targets (only those under ``<devfs>/nvidia``: ``/dev/nvidiactl``,
``/dev/nvidia-uvm``, ``/dev/nvidiaN``, ``/dev/nvidia-caps/...``), ``/proc/PID/exe`` and
``/proc/PID/cmdline``. The command line is reduced to a digest at once: it is compared, never
kept or exported (it can hold secrets). The digest is Python's ``hash`` of the bytes (SipHash,
keyed per process), enough for an equality test inside one daemon and, unlike ``hashlib``, it
does not load libcrypto into the daemon (bench/rss.py).

Cost: one readlink per open fd of each process in a rank tree (a rank holds ~100 fds).
Privilege: other users' ``fd``/``exe`` need CAP_SYS_PTRACE (granted in the systemd unit); without it
the evidence is None and nothing is flagged.
Shell equivalent: ``ls -l /proc/PID/fd | grep nvidia; readlink /proc/PID/exe; tr '\\0' ' ' <
/proc/PID/cmdline``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from gpuwatchd.paths import HostPaths


@dataclass(frozen=True)
class ProcEvidence:
    pid: int
    ppid: int
    exe: str
    cmdline_digest: str
    nvidia_fds: tuple[tuple[int, str], ...]  # (fd number, device path), sorted

    @property
    def holds_cuda_device(self) -> bool:
        """Has the control device or the UVM device open: what a CUDA context keeps open."""
        return any(t.endswith(("/nvidiactl", "/nvidia-uvm")) for _, t in self.nvidia_fds)


def read_evidence(paths: HostPaths, pid: int) -> ProcEvidence | None:
    """None when the process is gone or unreadable (not an error)."""
    prefix = paths.dev("nvidia")
    try:
        with open(paths.proc(pid, "stat"), "rb") as f:
            stat = f.read().decode("utf-8", "replace")
        ppid = int(stat[stat.rfind(")") + 2 :].split()[1])
        exe = os.readlink(paths.proc(pid, "exe"))
        with open(paths.proc(pid, "cmdline"), "rb") as f:
            digest = f"{hash(f.read(1 << 20)) & 0xFFFF_FFFF_FFFF_FFFF:016x}"
        fd_dir = paths.proc(pid, "fd")
        names = os.listdir(fd_dir)
    except (OSError, ValueError, IndexError):
        return None
    fds: list[tuple[int, str]] = []
    for name in names:
        try:
            target = os.readlink(os.path.join(fd_dir, name))
        except OSError:
            continue  # closed while we listed
        if target.startswith(prefix):
            fds.append((int(name), target))
    return ProcEvidence(pid, ppid, exe, digest, tuple(sorted(fds)))

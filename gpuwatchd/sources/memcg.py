"""Host memory of a rank and of the node: the memory cgroup the rank runs in, PSI, MemAvailable.

Reads, per rank process (each cycle):
- ``/proc/PID/cgroup``: the v1 ``memory`` controller's path and the v2 unified path (cached by
  the caller: a process rarely changes cgroup);
- cgroup v1 (``<root>/memory/<path>``): ``memory.usage_in_bytes``, ``memory.limit_in_bytes`` and
  ``memory.stat`` (``total_inactive_file``) of the cgroup and each ancestor that has a limit;
- cgroup v2 (``<root>/<path>``, or ``<root>/unified/<path>`` on a hybrid host): ``memory.current``,
  ``memory.max``, ``memory.high``, ``memory.stat`` (``inactive_file``), of the cgroup and its
  ancestors likewise; ``memory.pressure`` (PSI) of the rank's own cgroup where it exists (v2 and
  hybrid hosts with ``psi=1``);
and per node ``/proc/meminfo`` (MemTotal, MemAvailable) and ``/proc/pressure/memory``.

The limit that kills a rank is the tightest one on its path to the root (Slurm puts the job's
limit on ``job_N``, the rank in ``job_N/step_0/task_3``), so each level with a limit is read and the
level with the least headroom wins. Usage is compared with the limit as the *working set*: usage
minus inactive file cache, which the kernel reclaims before it OOM-kills (what kubelet calls
``container_memory_working_set_bytes``).

Cost: a handful of small reads per rank per cycle (depth of the cgroup path, at most ``MAX_DEPTH``
levels), each bounded to ``READ_CAP`` bytes. Privilege: none beyond reading /proc/PID/cgroup of
the rank (world-readable) and /sys/fs/cgroup (world-readable). Shell equivalent::

    cat /proc/PID/cgroup
    cat /sys/fs/cgroup/memory/<path>/memory.{usage_in_bytes,limit_in_bytes}      # v1
    cat /sys/fs/cgroup/<path>/memory.{current,max,high,pressure}                   # v2
    grep -E 'MemTotal|MemAvailable' /proc/meminfo; cat /proc/pressure/memory
"""

from __future__ import annotations

import os
from typing import Any

from gpuwatchd.model import CgroupMemory, CgroupPaths, NodeMemory, Psi
from gpuwatchd.paths import HostPaths, read_bounded

READ_CAP = 16384
MAX_DEPTH = 8
# v1 reports "no limit" as a page-rounded LONG_MAX (9223372036854771712); anything this large is none
UNLIMITED = 1 << 60


def read_capped(path: str) -> str | None:
    try:
        return read_bounded(path, READ_CAP).decode("ascii", "replace")
    except OSError:
        return None


def _int(text: str | None) -> int | None:
    if text is None:
        return None
    t = text.strip()
    if t == "max":
        return UNLIMITED
    return int(t) if t.isdigit() and len(t) < 25 else None


def parse_cgroup_file(text: str) -> CgroupPaths:
    """``/proc/PID/cgroup`` -> the v1 memory path, the v2 path and the v1 cpu path: the one parser
    of the file (the process view reads it, daemon/proc_view.py; memory, the OOM attribution and
    the straggler's cpu.stat take their paths from there)."""
    memory = unified = cpu = ""
    for line in text.splitlines():
        _id, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if controllers == "" and _id == "0":
            unified = path
            continue
        names = controllers.split(",")
        if "memory" in names:
            memory = path
        if "cpu" in names:
            cpu = path
    return CgroupPaths(memory, unified, cpu)


def parse_psi(text: str | None) -> Psi | None:
    """``some avg10=1.23 avg60=... total=N`` (+ ``full ...``) -> Psi; None when unreadable."""
    if not text:
        return None
    lines: dict[str, dict[str, str]] = {}
    for line in text.splitlines()[:4]:
        kind, _, rest = line.partition(" ")
        lines[kind] = dict(kv.partition("=")[::2] for kv in rest.split())
    try:
        some = lines["some"]
        full = lines.get("full")
        return Psi(
            some_avg10=float(some["avg10"]) / 100.0,
            full_avg10=float(full["avg10"]) / 100.0 if full else None,
            some_total_seconds=int(some["total"]) / 1e6,
            full_total_seconds=int(full["total"]) / 1e6 if full else None,
        )
    except (KeyError, ValueError):
        return None


def _stat_value(text: str | None, key: str) -> int:
    for line in (text or "").splitlines():
        k, _, v = line.partition(" ")
        if k == key:
            return int(v) if v.strip().isdigit() else 0
    return 0


def parse_meminfo(text: str | None) -> tuple[int, int] | None:
    """(MemTotal, MemAvailable) in bytes from /proc/meminfo."""
    vals: dict[str, int] = {}
    for line in (text or "").splitlines():
        k, _, v = line.partition(":")
        if k in ("MemTotal", "MemAvailable"):
            num = v.split()[0] if v.split() else ""
            if num.isdigit():
                vals[k] = int(num) * 1024
    if "MemTotal" in vals and "MemAvailable" in vals:
        return vals["MemTotal"], vals["MemAvailable"]
    return None


class MemcgReader:
    """``cgroup_root``: where the cgroup file systems are mounted (``/sys/fs/cgroup``; a fixture
    tree in tests). The layout is detected once: v1 (``memory/`` below the root), pure v2
    (``cgroup.controllers`` in the root) or hybrid (v1 plus ``unified/`` for PSI)."""

    def __init__(self, paths: HostPaths | None = None, cgroup_root: str | None = None) -> None:
        self.paths = paths or HostPaths()
        self.root = cgroup_root or self.paths.sys("fs", "cgroup")
        self.v1 = os.path.isfile(os.path.join(self.root, "memory", "memory.usage_in_bytes"))
        if os.path.isfile(os.path.join(self.root, "cgroup.controllers")):
            self.v2_root: str | None = self.root
        elif os.path.isfile(os.path.join(self.root, "unified", "cgroup.procs")):
            self.v2_root = os.path.join(self.root, "unified")
        else:
            self.v2_root = None

    @property
    def available(self) -> bool:
        return self.v1 or self.v2_root is not None

    def read(self, where: CgroupPaths, memo: dict[tuple[int, str], Any] | None = None) -> CgroupMemory | None:
        """The bounding level of ``where``'s memory cgroup; None when no memory controller.
        ``memo``: levels (and pressure, version 0) already read this cycle: ranks of one job
        share their job's cgroup."""
        memo = {} if memo is None else memo
        psi = None
        if self.v2_root is not None and where.unified:
            if (0, where.unified) not in memo:
                memo[(0, where.unified)] = parse_psi(
                    read_capped(self._dir(self.v2_root, where.unified, "memory.pressure"))
                )
            psi = memo[(0, where.unified)]
        if self.v1 and where.memory_v1:
            got = self._tightest(1, os.path.join(self.root, "memory"), where.memory_v1, memo)
        elif self.v2_root is not None and where.unified and self._has_memory(where.unified, memo):
            got = self._tightest(2, self.v2_root, where.unified, memo)
        else:
            return None
        if got is None:
            return None
        return CgroupMemory(
            got.version, got.path, got.usage_bytes, got.working_set_bytes, got.limit_bytes, got.high_bytes, psi
        )

    def _has_memory(self, unified: str, memo: dict[tuple[int, str], Any]) -> bool:
        """Has this v2 cgroup the memory controller (``memory.current``)? Once per cycle."""
        key = (3, unified)
        if key not in memo:
            assert self.v2_root is not None
            memo[key] = os.path.isfile(self._dir(self.v2_root, unified, "memory.current"))
        return bool(memo[key])

    @staticmethod
    def _dir(base: str, path: str, name: str) -> str:
        rel = os.path.normpath("/" + path).lstrip("/")  # never above the hierarchy's root
        return os.path.join(base, rel, name)

    def _level(self, version: int, base: str, path: str, own: bool) -> CgroupMemory | None:
        """One level; an ancestor without a limit is not read further (it cannot bound)."""
        limit = _int(read_capped(self._dir(base, path, "memory.limit_in_bytes" if version == 1 else "memory.max")))
        if not own and (limit is None or limit >= UNLIMITED):
            return None
        if version == 1:
            usage = _int(read_capped(self._dir(base, path, "memory.usage_in_bytes")))
            high = None
            inactive = _stat_value(read_capped(self._dir(base, path, "memory.stat")), "total_inactive_file")
        else:
            usage = _int(read_capped(self._dir(base, path, "memory.current")))
            high = _int(read_capped(self._dir(base, path, "memory.high")))
            inactive = _stat_value(read_capped(self._dir(base, path, "memory.stat")), "inactive_file")
        if usage is None:
            return None
        return CgroupMemory(
            version,
            path or "/",
            usage,
            max(0, usage - inactive),
            limit if limit is not None and limit < UNLIMITED else None,
            high if high is not None and high < UNLIMITED else None,
        )

    def _tightest(
        self, version: int, base: str, path: str, memo: dict[tuple[int, str], CgroupMemory | None]
    ) -> CgroupMemory | None:
        """The rank's own level, unless an ancestor with a limit has less headroom."""
        parts = [p for p in os.path.normpath("/" + path).split("/") if p]
        if len(parts) > MAX_DEPTH:
            return None

        def level_at(depth: int) -> CgroupMemory | None:
            rel = "/" + "/".join(parts[:depth])
            own = depth == len(parts)
            key = (version, rel + ("" if own else "/.."))  # an ancestor's read skips unlimited
            if key not in memo:
                memo[key] = self._level(version, base, rel, own)
            return memo[key]

        own = level_at(len(parts))
        if own is None:
            return None
        best = own
        for depth in range(len(parts), 0, -1):
            level = own if depth == len(parts) else level_at(depth)
            if level is None or level.limit_bytes is None:
                continue
            room = level.limit_bytes - level.working_set_bytes
            if best.limit_bytes is None or room < best.limit_bytes - best.working_set_bytes:
                best = level
        return best

    def own_limit_bytes(self, cgroup_file: str = "/proc/self/cgroup") -> int | None:
        """The memory limit that bounds the calling process (the daemon itself: the unit's
        ``MemoryMax=``, the pod's ``limits.memory``): the smallest limit on its cgroup path,
        None without one. Only the limit files are read (0.56 ms on the shared VM, against
        1.5 ms through ``read()``, which reads usage and memory.stat too), from this process's
        own view (``/proc/self``, the ``/sys/fs/cgroup`` it sees), never the watched host's."""
        text = read_capped(cgroup_file)
        if text is None:
            return None
        where = parse_cgroup_file(text)
        if self.v1 and where.memory_v1:
            base, path, name = os.path.join(self.root, "memory"), where.memory_v1, "memory.limit_in_bytes"
        elif self.v2_root is not None and where.unified:
            base, path, name = self.v2_root, where.unified, "memory.max"
        else:
            return None
        parts = [p for p in os.path.normpath("/" + path).split("/") if p][:MAX_DEPTH]
        limits = []
        for depth in range(len(parts), -1, -1):  # own level first; the root has no limit file
            limit = _int(read_capped(self._dir(base, "/".join(parts[:depth]), name)))
            if limit is not None and limit < UNLIMITED:
                limits.append(limit)
        return min(limits) if limits else None

    def node(self) -> NodeMemory | None:
        mem = parse_meminfo(read_capped(self.paths.proc("meminfo")))
        if mem is None:
            return None
        return NodeMemory(mem[0], mem[1], parse_psi(read_capped(self.paths.proc("pressure", "memory"))))

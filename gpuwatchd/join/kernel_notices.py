"""Kernel log lines that are not an OOM kill of the kernel's own: a systemd-oomd cgroup kill, an
Xid, a GPU fallen off the bus; each one -> events attributed to ranks and GPUs, counted once.

``KernelNotices`` is a small object that ``KernelEventProcessor`` (join/kernel_events.py) holds and
calls from ``handle`` in the kernel-log thread, under the processor's lock; what it reads is given
to its constructor: the event store (exactly-once counting), the rank-tree record (who was which
rank), the ranks of this cycle (peers alive), the boot's OOM baseline (history is not news) and
the Xid de-duplicator shared with the NVML watcher. It keeps the GPUs' PCI-address -> UUID map the
driver prints and the fallen-off-the-bus de-duplication. Cost: a dictionary look-up per line
(ranks by cgroup, GPUs by PCI address), Xid de-duplication against the NVML watcher.
"""

from __future__ import annotations

from dataclasses import replace

from gpuwatchd.events.store import EventStore
from gpuwatchd.join.bus_lost import BusLostDedup
from gpuwatchd.join.oom_history import HistoryKill, OomBaseline
from gpuwatchd.join.oom_kills import Kill
from gpuwatchd.join.rank_peers import RankPeers
from gpuwatchd.join.rank_trees import RankTreeRecord
from gpuwatchd.join.xid_dedup import XidDeduper
from gpuwatchd.model import INFO, PAGE, WARNING, frozen_map
from gpuwatchd.model.events import Event
from gpuwatchd.model.kernel import CRITICAL_XIDS, KILLER_OOMD, LogRecord, Parsed
from gpuwatchd.units import fmt_time


def is_history(baseline: OomBaseline, k: Kill) -> bool:
    """Was ``k`` before this boot's first start of the daemon (oom_history.py)?"""
    return baseline.is_history(HistoryKill(k.pid, k.comm, k.killer, k.time, k.rss_bytes, k.memcg))


class KernelNotices:
    """systemd-oomd, Xid and fallen-off-the-bus lines -> events (see the module docstring). Not
    locked: the processor calls it under its own lock."""

    def __init__(
        self,
        store: EventStore,
        record: RankTreeRecord,
        peers: RankPeers,
        baseline: OomBaseline,
        xid_dedup: XidDeduper | None,
    ) -> None:
        self.store = store
        self.record = record
        self.peers = peers
        self.baseline = baseline
        self.xid_dedup = xid_dedup
        self._pci_uuid: dict[str, str] = {}
        self._bus_lost = BusLostDedup()

    def gpu_at(self, pci: str, uuid: str) -> None:
        """The driver named the GPU at ``pci``: its UUID, for the Xids that name only the address."""
        self._pci_uuid[pci] = uuid

    def gpu_named(self, pci: str, at: float) -> None:
        """A driver line named the GPU at ``pci`` (a fallen-off-the-bus message may follow)."""
        self._bus_lost.named(pci, at)

    def oomd(self, rec: LogRecord, p: Parsed) -> list[Event]:
        """systemd-oomd kills a whole cgroup: one event per rank process that lived in it."""
        cgroup = p.fields.get("cgroup", "")
        if is_history(self.baseline, Kill(0, "", KILLER_OOMD, rec.boot_id, rec.realtime, None, memcg=cgroup)):
            return []
        victims = self.record.ranks_in_cgroup(cgroup, rec.realtime)
        stamp = int(rec.realtime * 1e6)
        out: list[Event] = []
        if not victims:
            k = Kill(0, "", KILLER_OOMD, rec.boot_id, rec.realtime, None, memcg=cgroup)
            ev = Event(
                key=f"{rec.boot_id}:{KILLER_OOMD}:{cgroup}:{stamp}",
                kind="oom_kill",
                time=k.time,
                severity=WARNING,
                summary=f"systemd-oomd killed cgroup {cgroup} at {fmt_time(k.time)} "
                f"({p.fields.get('reason', '')}); no known rank lived in it",
                killer=KILLER_OOMD,
                boot_id=rec.boot_id,
                counter="oom_kills",
                labels=("", "", "", KILLER_OOMD),
                fields=frozen_map({"memcg": cgroup, "source": rec.source}),
            )
            return [e for e in [self.store.emit(ev)] if e is not None]
        for m in victims:
            peers, _ = self.peers.peers_alive(m.job_id, m.rank)
            summary = (
                f"rank {m.rank} of job {m.job_id} (pid {m.pid}, {m.comm}) was killed by "
                f"systemd-oomd at {fmt_time(rec.realtime)} with its cgroup {cgroup} "
                f"({p.fields.get('reason', '')})"
            )
            if peers:
                summary += f"; {peers} peers alive: they will wait in their next collective"
            ev = Event(
                key=f"{rec.boot_id}:{KILLER_OOMD}:{m.pid}:{stamp}",
                kind="oom_kill",
                time=rec.realtime,
                severity=PAGE,
                summary=summary,
                job_id=m.job_id,
                rank=str(m.rank),
                pid=m.pid,
                comm=m.comm,
                killer=KILLER_OOMD,
                boot_id=rec.boot_id,
                counter="oom_kills",
                labels=(m.job_id, str(m.rank), m.comm, KILLER_OOMD),
                fields=frozen_map({"memcg": cgroup, "peers_alive": peers, "source": rec.source}),
                alert=True,
            )
            out += [e for e in [self.store.emit(ev)] if e is not None]
        return out

    def bus_lost(self, rec: LogRecord, p: Parsed) -> Event | None:
        """A GPU fell off the bus, said without an Xid number: an Xid 79 event (bus_lost.py)."""
        pci = self._bus_lost.pci_for(p.fields.get("pci", ""), rec.realtime)
        f = {**p.fields, "pci": pci, "xid": "79"}
        return self.xid(rec, replace(p, fields=f))

    def xid(self, rec: LogRecord, p: Parsed) -> Event | None:
        f = p.fields
        pci = f.get("pci", "")
        try:
            xid = int(f.get("xid", ""))
        except ValueError:
            return None
        stamp = rec.monotonic_usec if rec.monotonic_usec is not None else int(rec.realtime * 1e6)
        no_xid = p.kind == "bus_lost"
        key = f"{rec.boot_id}:{'bus_lost' if no_xid else 'xid'}:{pci}:{xid}:{stamp}"
        if self.store.has_kernel_key(key):
            return None
        gpu, uuid = "", self._pci_uuid.get(pci, "")
        count = xid != 79 or self._bus_lost.count(pci, rec.realtime, no_xid)
        if self.xid_dedup is not None:
            if count:
                count = bool(self.xid_dedup.record(pci, xid, rec.realtime, "kernel"))
            g, u = self.xid_dedup.labels_for(pci)
            gpu, uuid = g or gpu, u or uuid
        m = self.record.lookup(p.pid, rec.realtime) if p.pid is not None else None
        critical = xid in CRITICAL_XIDS
        who = ""
        if m is not None:
            who = f", process of rank {m.rank} of job {m.job_id} (pid {p.pid})"
        elif p.pid is not None:
            who = f", pid {p.pid} ({p.comm})"
        gpu_txt = f"GPU {gpu}" if gpu else "GPU"
        summary = (
            f"{gpu_txt} at PCI {pci}{' ' + uuid if uuid else ''} reported Xid {xid} at "
            f"{fmt_time(rec.realtime)}{who}: {f.get('rest', '')[:200]}"
        )
        if no_xid:
            rest = " ".join(x.strip() for x in f.get("rest", "").replace("\\x0a", "\n").split("\n"))
            summary = (
                f"{gpu_txt} at PCI {pci or 'unknown'}{' ' + uuid if uuid else ''} fell off the bus "
                f"at {fmt_time(rec.realtime)} (driver message without an Xid number, counted as "
                f"Xid 79): {rest[:200]}"
            )
        fields = {"xid": xid, "gpu": gpu, "uuid": uuid, "pci": pci, "source": rec.source}
        for k in ("gi", "ci"):
            if k in f:
                fields["mig_" + k] = f[k]
        if no_xid:
            fields.update(detail="fallen off the bus, no Xid number", pci_id=f.get("pci_id", ""))
        return self.store.emit(
            Event(
                key=key,
                kind="xid",
                time=rec.realtime,
                severity=PAGE if critical else INFO,
                summary=summary,
                job_id=m.job_id if m else "",
                rank=str(m.rank) if m else "",
                pid=p.pid,
                comm=p.comm,
                boot_id=rec.boot_id,
                # counted by the NVML watcher already: stored (once), not counted again
                counter="gpu_xid_errors" if count else "",
                labels=(gpu, uuid, str(xid)) if count else (),
                fields=frozen_map(fields),
                alert=critical,
            )
        )

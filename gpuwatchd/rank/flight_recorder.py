"""Rank side of the flight-recorder dump: answers the daemon's request from a small thread.

Runs *inside the training process* (started by ``gpuwatchd.register_rank()``): it imports only the
standard library, never the daemon or prometheus_client, and touches torch only if the script has
already imported it. PyTorch's flight recorder keeps the last ``TORCH_FR_BUFFER_SIZE`` (default
2000) collectives of each process group with their sequence number and state, for gloo and NCCL
alike; ``torch._C._distributed_c10d._dump_fr_trace_json()`` returns it as JSON (torch 2.11).

Protocol (files in the rank directory, names outside ``*.json`` so the rank-file scan skips them):
the daemon writes ``JOB.RANK.frreq`` holding a nonce when a rank of the job looks stalled; this
thread ``lstat``s that file every ``poll_seconds`` and, for a new nonce in a regular file (never
through a link, never blocking on a FIFO), writes ``JOB.RANK.fr`` atomically (rank/rankdir.py):
``{"version": 1, "nonce", "pid", "time", "trace": {...}}`` or ``"error"``. The trace
is cut to what the daemon needs (the last ``MAX_ENTRIES`` entries, a few fields each, at most
``MAX_BYTES``): the daemon reads it as JSON only, never a pickle. The GIL is free while the main
thread waits in a collective (c10d releases it), so the answer comes even from a hung rank.

Cost in the rank: one ``stat`` per ``poll_seconds``; a dump only on request.
"""

from __future__ import annotations

import json
import logging
import os
import stat as statmod
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from gpuwatchd.rank import rankdir

log = logging.getLogger(__name__)
REQUEST_SUFFIX = ".frreq"
RESPONSE_SUFFIX = ".fr"
MAX_ENTRIES = 64  # per process group, newest kept
MAX_BYTES = 256 * 1024
MAX_REQUEST_BYTES = 128
ENTRY_FIELDS = (
    "collective_seq_id",
    "p2p_seq_id",
    "profiling_name",
    "state",
    "pg_id",
    "time_created_ns",
    "is_p2p",
    "process_group",
)

Dump = Callable[[], Any]


def request_path(rank_dir: str, job_id: str, rank: int) -> str:
    return os.path.join(rank_dir, f"{job_id}.{rank}{REQUEST_SUFFIX}")


def response_path(rank_dir: str, job_id: str, rank: int) -> str:
    return os.path.join(rank_dir, f"{job_id}.{rank}{RESPONSE_SUFFIX}")


def torch_dump() -> Any:
    """The flight recorder of this process as parsed JSON; RuntimeError when there is none."""
    torch = sys.modules.get("torch")
    if torch is None:
        raise RuntimeError("torch is not imported in this process")
    c10d = getattr(getattr(torch, "_C", None), "_distributed_c10d", None)
    fn = getattr(c10d, "_dump_fr_trace_json", None) or getattr(c10d, "_dump_nccl_trace_json", None)
    if fn is None:
        raise RuntimeError("this torch has no flight recorder (_dump_fr_trace_json)")
    raw = fn()
    return json.loads(raw) if isinstance(raw, (str, bytes)) else raw


def trim(trace: Any) -> dict[str, Any]:
    """The parts the daemon reads: entries (newest MAX_ENTRIES per group, selected fields),
    pg_status and pg_config, as plain JSON values."""
    if not isinstance(trace, Mapping):
        raise ValueError("flight recorder dump is not a JSON object")
    entries = [e for e in trace.get("entries") or () if isinstance(e, Mapping)]
    by_pg: dict[str, list[dict[str, Any]]] = {}
    for e in entries:
        by_pg.setdefault(str(e.get("pg_id")), []).append({k: e[k] for k in ENTRY_FIELDS if k in e})
    kept = [e for group in by_pg.values() for e in group[-MAX_ENTRIES:]]
    out: dict[str, Any] = {"entries": kept}
    for key in ("pg_status", "pg_config", "version"):
        if key in trace:
            out[key] = trace[key]
    return out


class Responder:
    """The polling thread. ``dump`` is the flight-recorder reader (tests pass a recording)."""

    def __init__(
        self, rank_dir: str, job_id: str, rank: int, *, dump: Dump = torch_dump, poll_seconds: float = 0.5
    ) -> None:
        self.req = request_path(rank_dir, job_id, rank)
        self.resp = response_path(rank_dir, job_id, rank)
        self.dump = dump
        self.poll_seconds = poll_seconds
        self.answered = ""
        self._seen: tuple[int, int] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpuwatchd-fr", daemon=True)

    def start(self) -> Responder:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_seconds):
            try:
                self.poll_once()
            except Exception as e:  # noqa: BLE001 - a monitoring thread must never end the job
                log.debug("gpuwatchd flight-recorder responder: %s", e)

    def poll_once(self) -> bool:
        """Answer a new request, if there is one; returns whether it answered."""
        try:
            st = os.lstat(self.req)
        except OSError:
            return False
        key = (st.st_ino, st.st_mtime_ns)
        if key == self._seen or not statmod.S_ISREG(st.st_mode):
            return False  # a link, a FIFO, a directory: another user's, never opened
        self._seen = key
        nonce = _read_request(self.req, st)
        if not nonce or nonce == self.answered:
            return False
        doc: dict[str, Any] = {"version": 1, "nonce": nonce, "pid": os.getpid(), "time": time.time()}
        try:
            doc["trace"] = trim(self.dump())
        except Exception as e:  # noqa: BLE001 - whatever torch raises is the answer
            doc["error"] = f"{type(e).__name__}: {e}"[:300]
        text = json.dumps(doc, separators=(",", ":"), default=str)
        while len(text) > MAX_BYTES and doc.get("trace", {}).get("entries"):
            doc["trace"]["entries"] = doc["trace"]["entries"][len(doc["trace"]["entries"]) // 2 :]
            text = json.dumps(doc, separators=(",", ":"), default=str)
        directory, name = os.path.split(self.resp)
        dir_fd = rankdir.open_dir(directory, create=False)
        try:
            rankdir.write_new(
                dir_fd, name, name[: -len(RESPONSE_SUFFIX)], RESPONSE_SUFFIX, text.encode(), fallback=False
            )
        finally:
            os.close(dir_fd)
        self.answered = nonce
        return True


def _read_request(path: str, st: os.stat_result) -> str:
    """The nonce in the request ``path`` that ``lstat`` found a regular file: opened without
    following a link or blocking (a FIFO swapped in since is opened at once and refused), and
    read only when it is still that file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return ""
    try:
        fst = os.fstat(fd)
        if (fst.st_ino, fst.st_dev) != (st.st_ino, st.st_dev) or not statmod.S_ISREG(fst.st_mode):
            return ""
        return os.read(fd, MAX_REQUEST_BYTES).decode("ascii", "replace").strip()
    finally:
        os.close(fd)


_responder: Responder | None = None


def start(rank_dir: str, job_id: str, rank: int, dump: Dump | None = None) -> Responder:
    """Start (or restart for a new registration) this process's responder."""
    global _responder
    if _responder is not None:
        _responder.stop()
    _responder = Responder(rank_dir, job_id, rank, dump=dump or torch_dump).start()
    return _responder

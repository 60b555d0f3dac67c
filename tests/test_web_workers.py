"""The /metrics server's worker threads (gpuwatchd/web/workers.py): at most ``max_workers``, each
answering one request at a time and handing the connection back; and, for real, a request that
arrives when no thread can be started (a pids cgroup at its limit, as under systemd's TasksMax=)
is dropped as ``no_thread`` and counted, and the server answers again once threads can start.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

from gpuwatchd.web.connection import Conn
from gpuwatchd.web.workers import WorkerPool

PIDS_ROOT = Path("/sys/fs/cgroup/pids")


def _conn() -> tuple[Conn, socket.socket]:
    a, b = socket.socketpair()
    return Conn(a, "127.0.0.1", None, time.monotonic() + 10), b


def _workers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "gpuwatchd-web-worker"]


def test_at_most_max_workers_answer_at_once_and_every_connection_comes_back() -> None:
    release = threading.Event()
    answering: list[Conn] = []
    back: list[tuple[Conn, bool]] = []
    lock = threading.Lock()

    def serve(conn: Conn) -> bool:
        with lock:
            answering.append(conn)
        release.wait(30)
        return conn.addr == "127.0.0.1"

    def done(conn: Conn, keep: bool) -> None:
        with lock:
            back.append((conn, keep))

    pool = WorkerPool(2, serve, done)
    before = set(_workers())  # a worker of an earlier test's server may still be ending
    pairs = [_conn() for _ in range(5)]
    try:
        assert all(pool.submit(c) for c, _ in pairs)
        deadline = time.monotonic() + 30
        while len(answering) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(answering) == 2  # two answering, three queued
        assert len(set(_workers()) - before) == 2
        assert sorted(c.phase for c, _ in pairs) == ["active", "active", "ready", "ready", "ready"]
        release.set()
        while len(back) < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sorted(id(c) for c, _ in back) == sorted(id(c) for c, _ in pairs)
        assert all(keep for _, keep in back)
    finally:
        release.set()
        pool.stop()
        for c, other in pairs:
            c.sock.close()
            other.close()
    deadline = time.monotonic() + 30
    while set(_workers()) - before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not set(_workers()) - before  # stop() ends them


SCRIPT = textwrap.dedent("""
    import os, socket, sys, time
    from prometheus_client import CollectorRegistry
    from gpuwatchd.counters import CounterStore
    from gpuwatchd.web import server as web

    cg = sys.argv[1]
    counters = CounterStore()
    srv = web.serve(CollectorRegistry(), "127.0.0.1:0", None, counters=counters)

    def get():
        with socket.create_connection(srv.address, timeout=20) as c:
            c.sendall(b"GET /metrics HTTP/1.1\\r\\nHost: x\\r\\nConnection: close\\r\\n\\r\\n")
            out = b""
            try:
                while chunk := c.recv(65536):
                    out += chunk
            except ConnectionResetError:
                pass
            return out

    with open(cg + "/cgroup.procs", "w") as f:
        f.write(str(os.getpid()))
    # the loop thread runs, no worker has started: no task more than there are now
    with open(cg + "/pids.max", "w") as f:
        f.write(str(len(os.listdir("/proc/self/task"))))
    first = get()
    deadline = time.monotonic() + 20  # counted by the loop just after it closed the connection
    while not counters.get("web_connections_dropped", ("no_thread",)) and time.monotonic() < deadline:
        time.sleep(0.01)
    dropped = counters.get("web_connections_dropped", ("no_thread",))
    with open(cg + "/pids.max", "w") as f:
        f.write("max")
    second = get()
    print(repr(first[:12]), dropped, repr(second[:12]), sep="|", flush=True)
    srv.close()
""")


def test_a_request_no_thread_can_answer_is_dropped_as_no_thread_then_served_again(tmp_path: Path) -> None:
    cg = PIDS_ROOT / f"gwmixins-{uuid.uuid4().hex[:8]}"
    cg.mkdir()
    try:
        script = tmp_path / "no_thread.py"
        script.write_text(SCRIPT)
        out = subprocess.run(
            [sys.executable, str(script), str(cg)],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        assert out.returncode == 0, out.stderr
        first, dropped, second = out.stdout.strip().split("|")
        assert first == "b''"  # closed without an answer
        assert float(dropped) == 1.0
        assert second == repr(b"HTTP/1.1 200")
    finally:
        deadline = time.monotonic() + 30
        while True:  # the child has exited: the cgroup empties as it is reaped
            try:
                cg.rmdir()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

"""Connections of the /metrics server: accepted, TLS-handshaken, read up to a complete request
head and written to by one thread (an epoll loop), so that a connection which sends nothing, a
byte at a time (slowloris), or reads its answer slowly costs a file descriptor and a small
buffer, never a thread.

Only a connection whose request is complete goes to a worker thread (at most ``max_workers``),
which builds the response in memory (the exporter's cached bytes, shared) and gives it back to
the loop to write: no worker ever waits on a client. The bytes are framed into
requests by web/request.py (h11): a head is found here and must fit ``max_head_bytes`` however it
arrives, a body is read and discarded, and what follows a request is the next one (pipelining;
a client that half-closes after its requests still gets every answer). When ``max_connections``
are open, a new connection takes the place of one *waiting on its client* (handshake, request
head, response not yet read, keep-alive idle), by tier: one that never completed a request, then
one answered, then one served (a scraper's idle keep-alive); within a tier, of the address
holding the most, with the fewest answers, the first to wait (web/connection.py ``victim_of``): a flooder pushes out
its own. None is pushed out sooner than ``eviction_grace`` (0.2 s) after it began to wait, nor a
higher tier while a lower one is in its grace (a reconnecting flood stays younger than that);
newcomers wait in the accept queue meanwhile (``BACKLOG``, 4096, capped by net.core.somaxconn).
A new connection then waits about (hostile - max_connections) * eviction_grace / max_connections
there: 0.4 s for 200 against 64; past max_connections + BACKLOG the kernel drops SYNs and the
client retransmits after 1, 3, 7 s (docs/security.md).

No client's bytes hold the loop: each turn reads the connections with data before it accepts
(at most ``ACCEPT_BATCH``); a read is at most ``RECVS_PER_READ`` recv calls, and a request that
did not arrive whole is read again at most every ``read_pace`` (its bytes wait in the kernel); a
body is at most 64 KiB in 16 pieces (web/request.py). 32 one-byte-chunk body streams under
CPUQuota=25% delayed scrapes 7.2 s, now 0.22 s (tests/test_web_quota.py).

Deadlines: TLS handshake and request head within ``request_timeout`` of the accept, the response
read by the client within ``write_timeout``, keep-alive idle ``idle_timeout``. Connections dropped
for lack of room, for a missed deadline or for lack of a thread are passed to ``on_drop(reason)``
(the daemon counts them in ``gpuwatch_web_connections_dropped_total``) and logged as one warning
per ``log_interval`` seconds, however many there were.

Cost: one thread for this loop and up to ``max_workers`` workers (web/workers.py's
``WorkerPool``: a worker hands a connection back answered through ``Listener.hand_back``); per
connection one fd, at most ``max_head_bytes`` of request and its response's headers; the loop
wakes for I/O, ``stop()`` and the nearest deadline only (bench/cycle_profile.py). Privilege: none.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import functools
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from gpuwatchd.isolation import guarded
from gpuwatchd.web import request
from gpuwatchd.web.connection import (
    MAX_REQUEST_LINE,
    Conn,
    DropLog,
    Limits,
    shutdown_socket,
    tls_retry_errors,
    victim_of,
)
from gpuwatchd.web.workers import WorkerPool

if TYPE_CHECKING:
    import ssl

log = logging.getLogger(__name__)

# Accepts per loop turn, so a connect flood cannot starve the reads (each reads what came with
# it: a reconnecting body flood under CPUQuota=25% gave scrapes p50 0.23 s at 32, 0.11 s at 8).
ACCEPT_BATCH = 8
RECVS_PER_READ = 64  # a TLS client sending 1-byte records made 32,768 recv calls per read

_LISTEN = object()
_WAKE = object()


class Listener:
    """Runs the loop on its own thread once ``start()`` is called; ``serve(conn)`` (in a worker
    thread, must not raise) answers ``conn.head`` by queueing its response on ``conn.out`` and says
    whether to keep the connection afterwards."""

    def __init__(
        self,
        sock: socket.socket,
        limits: Limits,
        tls: Callable[[], ssl.SSLContext | None],
        allowed: Callable[[ssl.SSLSocket], bool],
        serve: Callable[[Conn], bool | None],
        on_drop: Callable[[str], None],
    ) -> None:
        self.sock = sock
        self.limits = limits
        self.tls = tls
        self.allowed = allowed
        self.serve = serve
        self.drops = DropLog(on_drop, limits.log_interval)
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._waiting: collections.OrderedDict[Conn, None] = collections.OrderedDict()  # oldest first
        self._busy: dict[Conn, None] = {}  # ready or active; only the loop changes these two
        self._parked: dict[Conn, float] = {}  # out of the selector until their next paced read
        self._back: collections.deque[tuple[Conn, bool]] = collections.deque()  # from workers
        self.workers = WorkerPool(limits.max_workers, serve, self.hand_back)
        self._stop = threading.Event()
        self._accept_paused_until = 0.0
        self._thread = threading.Thread(target=self._run, name="gpuwatchd-web", daemon=True)
        name = sock.getsockname()
        self.address: tuple[str, int] = (str(name[0]), int(name[1]))

    def start(self) -> None:
        self._sel.register(self.sock, selectors.EVENT_READ, _LISTEN)
        self._sel.register(self._wake_r, selectors.EVENT_READ, _WAKE)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake()
        self.workers.stop()
        self._thread.join(timeout=5)  # the loop shuts every connection down as it ends

    # --- the loop -------------------------------------------------------------------------------

    def _run(self) -> None:
        tick = min(0.25, self.limits.request_timeout / 4)
        try:
            while not self._stop.is_set():
                # A bug met by one turn must not end the loop (and with it the server), nor spin
                # it writing the same error as fast as it can.
                if not guarded("web server loop", lambda: self._turn(tick), False):
                    self._stop.wait(0.1)
        finally:
            for conn in [*self._waiting, *self._busy]:
                shutdown_socket(conn.sock)
                conn.sock.close()
            self._sel.close()
            self.sock.close()
            self._wake_r.close()
            self._wake_w.close()

    def _timeout(self, tick: float) -> float | None:
        """Sleep until the nearest deadline (a connection's, an accept pause's end, the next drop
        log line; ``tick`` at most while a worker answers); None: only I/O or stop() wake it."""
        due = [c.deadline for c in self._waiting]
        due.extend(self._parked.values())
        if self._accept_paused_until:
            due.append(self._accept_paused_until)
        if self.drops.pending:
            due.append(self.drops.next_log)
        now = time.monotonic()
        if self._busy:
            due.append(now + tick)
        if not due:
            return None
        return max(0.0, min(due) - now + 0.001)  # just past it: _expire closes what is strictly late

    def _turn(self, tick: float) -> bool:
        accept = False
        timeout = self._timeout(tick)
        for key, _ in self._sel.select(timeout):
            if key.data is _LISTEN:
                accept = True
            elif key.data is _WAKE:
                with contextlib.suppress(OSError):
                    self._wake_r.recv(4096)
            elif isinstance(key.data, Conn):
                conn = key.data
                if not guarded(f"connection from {conn.addr}", functools.partial(self._on_event, conn), False):
                    self._discard(conn)
        self._unpark(time.monotonic())
        if accept:  # after the reads: a request that has arrived is read before newcomers
            self._accept()
        self._take_back()
        self._expire(time.monotonic())
        self.drops.flush()
        return True

    def _discard(self, conn: Conn) -> None:
        """Forget a connection whatever state a bug left it in."""
        self._waiting.pop(conn, None)
        self._busy.pop(conn, None)
        self._parked.pop(conn, None)
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(conn.sock)
        shutdown_socket(conn.sock)
        conn.sock.close()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # full: the loop is awake already
            self._wake_w.send(b"\0")

    def _accept(self) -> None:
        for _ in range(ACCEPT_BATCH):
            full = len(self._waiting) + len(self._busy) >= self.limits.max_connections
            victim = None
            if full:
                victim, grace_end = victim_of(self._waiting, time.monotonic(), self.limits.eviction_grace)
                if victim is None and grace_end is not None:
                    # Newcomers wait in the backlog until a waiting connection has had its grace:
                    # no connection (maybe a scraper whose request is on its way) is pushed out
                    # sooner than eviction_grace after it began to wait.
                    self._pause_accept(grace_end)
                    return
            try:
                sock, addr = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE) and not self._evict_oldest():
                    # Out of file descriptors and nothing to give up: stop accepting for a
                    # moment instead of spinning on a listening socket that stays readable.
                    self._pause_accept(time.monotonic() + 0.2)
                    return
                continue
            host = str(addr[0])
            if full:
                if victim is None or victim not in self._waiting:
                    sock.close()  # every connection is being answered: the newest waits its turn
                    self.drops.drop("limit", host)
                    continue
                self._close(victim)
                self.drops.drop("limit", victim.addr)
            self._add(sock, host)

    def _pause_accept(self, until: float) -> None:
        if not self._accept_paused_until:
            self._sel.unregister(self.sock)
        self._accept_paused_until = until

    def _add(self, sock: socket.socket, host: str) -> None:
        sock.setblocking(False)
        # Headers and body leave in separate writes; without TCP_NODELAY the body of every
        # keep-alive response waits for the client's delayed ACK (~40 ms; bench/bench_web.py).
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        ctx = self.tls()
        deadline = time.monotonic() + self.limits.request_timeout
        if ctx is not None:
            try:
                sock = ctx.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
            except (OSError, ValueError) as e:
                log.debug("connection from %s ended: %s", host, e)
                sock.close()
                return
        conn = Conn(sock, host, ctx, deadline)
        self._waiting[conn] = None
        self._sel.register(sock, selectors.EVENT_READ, conn)
        if ctx is None:
            self._read(conn)  # a scraper's request usually arrived with its connection

    def _evict_oldest(self) -> bool:
        victim, _ = victim_of(self._waiting, time.monotonic(), 0.0)
        if victim is None:
            return False
        self._close(victim)
        self.drops.drop("limit", victim.addr)
        return True

    def _on_event(self, conn: Conn) -> bool:
        """Act on a readable or writable connection; True (False only through an exception)."""
        if conn.phase == "write":
            self._flush(conn)
            return True
        due = conn.read_at + self.limits.read_pace
        if conn.reading_partial() and time.monotonic() < due:
            # Part of its request came in the last read: the rest waits in the kernel for the
            # next read (``_unpark``): a byte at a time costs one read per read_pace, not per byte.
            self._sel.unregister(conn.sock)
            self._parked[conn] = due
            return True
        if conn.phase == "handshake":
            import ssl  # loaded already: this connection was wrapped in a TLS context

            sock = conn.sock
            assert isinstance(sock, ssl.SSLSocket)
            try:
                sock.do_handshake()
            except ssl.SSLWantReadError:
                self._sel.modify(sock, selectors.EVENT_READ, conn)
                return True
            except ssl.SSLWantWriteError:
                self._sel.modify(sock, selectors.EVENT_WRITE, conn)
                return True
            except (OSError, ValueError) as e:  # a client that fails the handshake ends itself
                log.debug("TLS handshake with %s failed: %s", conn.addr, e)
                self._close(conn)
                return True
            if not self.allowed(sock):
                log.info("client certificate of %s has no allowed SAN", conn.addr)
                self._close(conn)
                return True
            conn.phase = "head"
            self._sel.modify(sock, selectors.EVENT_READ, conn)
        self._read(conn)  # after a handshake too: its last flight may have carried the request
        return True

    def _unpark(self, now: float) -> None:
        """Read the parked connections whose pace allows it (and watch them again)."""
        for conn in [c for c, due in self._parked.items() if due <= now]:
            del self._parked[conn]
            self._sel.register(conn.sock, selectors.EVENT_READ, conn)
            if not guarded(f"connection from {conn.addr}", functools.partial(self._on_event, conn), False):
                self._discard(conn)

    def _read(self, conn: Conn) -> None:
        want_read, want_write = tls_retry_errors()
        conn.read_at = time.monotonic()
        capped = True  # unless the socket runs dry first: a TLS recv gives one record, maybe 1 byte
        for _ in range(RECVS_PER_READ):
            if len(conn.buf) > self.limits.max_head_bytes:
                break
            try:
                chunk = conn.sock.recv(16384)
            except (BlockingIOError, InterruptedError, want_read, want_write):
                capped = False
                break
            except (OSError, ValueError) as e:
                log.debug("connection from %s ended: %s", conn.addr, e)
                self._close(conn)
                return
            if not chunk:
                conn.eof, capped = True, False
                break
            if conn.phase == "idle":  # the next request began: its head has request_timeout
                conn.phase = "head"
                conn.deadline = time.monotonic() + self.limits.request_timeout
            conn.buf += chunk
        self._advance(conn)
        if capped and conn in self._waiting and conn.reading_partial() and conn not in self._parked:
            self._sel.unregister(conn.sock)  # the rest, maybe decrypted already, at the next pace
            self._parked[conn] = conn.read_at + self.limits.read_pace

    def _advance(self, conn: Conn) -> None:
        """Frame the next request out of ``conn.buf`` (web/request.py): its head, then its body,
        read and discarded; a complete request goes to a worker, an ambiguous one is refused."""
        if conn.request is None:
            if not conn.take_head():
                if conn.eof:
                    self._close(conn)
                elif conn.request_line_too_long():
                    self._refuse(conn, 414)
                elif len(conn.buf) > self.limits.max_head_bytes:
                    self._refuse(conn, 431)
                return
            # However the head arrived (in one write or byte by byte), its size is what counts.
            if len(conn.head) > self.limits.max_head_bytes:
                self._refuse(conn, 431)
                return
            if conn.head.find(b"\n", 0, MAX_REQUEST_LINE + 2) < 0:
                self._refuse(conn, 414)
                return
            try:
                conn.parser, conn.request = request.begin(conn.head)
            except request.Refused as e:
                log.debug("refused a request from %s: %s", conn.addr, e)
                self._refuse(conn, e.status)
                return
            conn.body_seen = conn.chunks = 0
        assert conn.parser is not None
        try:
            complete, conn.body_seen, conn.chunks = request.drain(conn.parser, conn.buf, conn.body_seen, conn.chunks)
        except request.Refused as e:
            log.debug("refused a request body from %s: %s", conn.addr, e)
            self._refuse(conn, e.status)
            return
        if not complete and conn.parser.they_are_waiting_for_100_continue:
            # Its body would come only after a 100 Continue: answer without reading it (h11 then
            # closes the connection, the body unread).
            complete = True
        if not complete:
            if conn.eof:
                self._close(conn)
            return
        self._sel.unregister(conn.sock)
        del self._waiting[conn]
        self._busy[conn] = None
        if not self.workers.submit(conn):
            del self._busy[conn]
            conn.sock.close()
            self.drops.drop("no_thread", conn.addr)

    def _refuse(self, conn: Conn, status: int) -> None:
        with contextlib.suppress(OSError, ValueError):
            conn.sock.send(request.refusal(status))
        log.debug("%d from %s", status, conn.addr)
        self._close(conn)

    def _close(self, conn: Conn) -> None:
        if conn in self._waiting:
            del self._waiting[conn]
            if self._parked.pop(conn, None) is None:
                self._sel.unregister(conn.sock)
        shutdown_socket(conn.sock)
        conn.sock.close()

    def _expire(self, now: float) -> None:
        if self._accept_paused_until and now >= self._accept_paused_until:
            self._accept_paused_until = 0.0
            self._sel.register(self.sock, selectors.EVENT_READ, _LISTEN)
        late = [c for c in self._waiting if c.deadline < now]
        for conn in late:
            self._close(conn)
            if conn.phase != "idle":  # an idle keep-alive connection ending is normal
                self.drops.drop("timeout", conn.addr)

    # --- answers handed back by the workers (web/workers.py) -----------------------------------

    def hand_back(self, conn: Conn, keep: bool) -> None:
        """In a worker (or the auth) thread: ``conn`` is answered; the loop writes it (or closes
        it)."""
        self._back.append((conn, keep))
        self._wake()

    def _take_back(self) -> None:
        now = time.monotonic()
        while self._back:
            conn, keep = self._back.popleft()
            del self._busy[conn]
            conn.parser = conn.request = None
            conn.answered += 1
            if conn.out and bytes(conn.out[0][9:10]) in (b"1", b"2", b"3"):  # "HTTP/1.1 200 ..."
                conn.served += 1
            if self._stop.is_set() or (not conn.out and (not keep or (conn.eof and not conn.buf))):
                shutdown_socket(conn.sock)
                conn.sock.close()
                continue
            if not keep:
                conn.buf.clear()  # nothing after this answer is read
                conn.eof = True
            # A client that half-closed after pipelining requests (eof) still gets every answer
            # whose request arrived complete, as http.server gives them; then the connection ends.
            conn.phase = "write"
            conn.deadline = now + self.limits.write_timeout
            conn.since = now  # the youngest waiting connection again
            self._waiting[conn] = None
            self._sel.register(conn.sock, selectors.EVENT_WRITE, conn)
            self._flush(conn)

    def _flush(self, conn: Conn) -> None:
        """Send what the client will take now; then wait for its next request, or close."""
        want_read, want_write = tls_retry_errors()
        while conn.out:
            chunk = conn.out[0][:65536]
            try:
                n = conn.sock.send(chunk)
            except (BlockingIOError, InterruptedError, want_write):
                self._sel.modify(conn.sock, selectors.EVENT_WRITE, conn)
                return
            except want_read:  # TLS 1.3 key update or renegotiation: read first
                self._sel.modify(conn.sock, selectors.EVENT_READ, conn)
                return
            except (OSError, ValueError) as e:
                log.debug("connection from %s ended: %s", conn.addr, e)
                self._close(conn)
                return
            # A TLS send that raised WANT_WRITE is retried with the same bytes, as OpenSSL needs.
            conn.out[0] = conn.out[0][n:]
            if not conn.out[0]:
                conn.out.popleft()
        if conn.eof and not conn.buf:
            self._close(conn)
            return
        now = time.monotonic()
        self._sel.modify(conn.sock, selectors.EVENT_READ, conn)
        if conn.buf:  # pipelined: the next request is here already
            conn.phase = "head"
            conn.deadline = now + self.limits.request_timeout
            self._advance(conn)
        else:
            conn.phase = "idle"
            conn.deadline = now + self.limits.idle_timeout
            pending = getattr(conn.sock, "pending", None)  # an ssl.SSLSocket's
            if pending is not None and pending():
                self._read(conn)  # decrypted bytes that epoll cannot see

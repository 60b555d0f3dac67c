"""One connection of the /metrics server and its bounds: the ``Limits``, a ``Conn``'s buffers and
phase (``Conn.out``: the response a handler queues), the ``DropLog`` of dropped connections,
and the listening socket (``bind``). No loop here: ``web/listener.py`` drives these.

Cost: per connection one fd, at most ``max_head_bytes`` of request (each byte searched once for
the end of the head, however slowly it arrives) and the queued response's memoryviews.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import re
import socket
import sys
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING

log = logging.getLogger(__name__)

BACKLOG = 4096  # capped by net.core.somaxconn (4096 by default since Linux 5.4); docs/security.md
MAX_REQUEST_LINE = 8192
# Where the request head ends: an empty line; h11 also accepts bare LF line ends.
HEAD_END = re.compile(rb"\r?\n\r?\n")
DROP_REASONS = ("limit", "timeout", "no_thread")

if TYPE_CHECKING:
    import ssl

    import h11


class _NotRaised(Exception):
    """Stands for ssl's exceptions while ssl is not imported: nothing can raise them then."""


def tls_retry_errors() -> tuple[type[Exception], type[Exception]]:
    """(``ssl.SSLWantReadError``, ``ssl.SSLWantWriteError``), once a TLS listener has imported
    ssl. Without TLS the daemon never imports it (libssl, libcrypto: bench/rss.py), and then no
    socket can raise them."""
    tls = sys.modules.get("ssl")
    if tls is None:
        return _NotRaised, _NotRaised
    return tls.SSLWantReadError, tls.SSLWantWriteError


@dataclass(frozen=True)
class Limits:
    """Bounds of the /metrics server (node_exporter's --web.max-requests is 40; Go's http.Server
    ReadHeaderTimeout/WriteTimeout/IdleTimeout play the same role as the timeouts)."""

    max_connections: int = 256  # open connections, waiting or being answered
    max_workers: int = 8  # requests answered at once, one thread each
    request_timeout: float = 10.0  # TLS handshake + request line + headers
    write_timeout: float = 30.0  # the client reading one response
    idle_timeout: float = 60.0  # keep-alive wait for the next request
    max_head_bytes: int = 32768  # request line + headers
    log_interval: float = 10.0  # at most one warning about dropped connections per interval
    eviction_grace: float = 0.2  # a waiting connection is never pushed out sooner
    # A request that did not arrive whole in one read is read again at most this often (its bytes
    # wait in the kernel meanwhile): a client streaming a head or body a byte at a time costs the
    # loop 10 reads a second, however fast it sends (web/listener.py).
    read_pace: float = 0.1


class Conn:
    """One client connection. ``phase``: handshake, head, write, idle (waiting on the client,
    owned by the loop), ready (queued for a worker), active (a worker is answering it)."""

    __slots__ = (
        "addr",
        "answered",
        "body_seen",
        "buf",
        "chunks",
        "ctx",
        "deadline",
        "eof",
        "head",
        "line_ok",
        "out",
        "parser",
        "phase",
        "read_at",
        "request",
        "scanned",
        "served",
        "since",
        "sock",
    )

    def __init__(self, sock: socket.socket, addr: str, ctx: ssl.SSLContext | None, deadline: float) -> None:
        self.sock = sock
        self.addr = addr
        self.ctx = ctx  # the TLS context this connection was accepted under (None: plain)
        self.buf = bytearray()
        self.head = b""
        # How far ``buf`` has been searched for the end of the head, and whether its request line
        # ended within MAX_REQUEST_LINE: each byte is looked at once, however slowly it arrives.
        self.scanned = 0
        self.line_ok = False
        self.phase = "handshake" if ctx is not None else "head"
        self.deadline = deadline
        self.since = time.monotonic()  # when it began to wait; the oldest is pushed out first
        self.eof = False  # the client closed its side after sending
        self.out: collections.deque[memoryview] = collections.deque()  # response not yet sent
        # The request being read or answered (web/request.py): its h11 connection, its head's
        # event once parsed, and how much of its body has been read and discarded.
        self.parser: h11.Connection | None = None
        self.request: h11.Request | None = None
        self.body_seen = 0
        self.chunks = 0  # body pieces h11 framed for this request (request.MAX_BODY_CHUNKS)
        # Requests answered on this connection, and of them those answered with a success (a
        # status below 400: what a scraper with the right credentials gets). A connection is
        # pushed out only after every one that never sent a complete request, and one that was
        # served after those answered with an error (``victim_of``).
        self.answered = 0
        self.served = 0
        self.read_at = float("-inf")  # the last read of the request being read (read_pace)

    def reading_partial(self) -> bool:
        """Has part of a request arrived, not all of it? (Its next read is paced.)"""
        return self.phase == "head" and (bool(self.buf) or self.request is not None)

    def tier(self) -> int:
        """0: never completed a request; 1: answered, never with a success; 2: served."""
        return 2 if self.served else 1 if self.answered else 0

    def take_head(self) -> bool:
        m = HEAD_END.search(self.buf, max(0, self.scanned - 3))
        if m is None:
            self.scanned = len(self.buf)
            return False
        self.head = bytes(self.buf[: m.end()])
        del self.buf[: m.end()]
        self.scanned = 0
        self.line_ok = False
        return True

    def request_line_too_long(self) -> bool:
        if self.line_ok or len(self.buf) <= MAX_REQUEST_LINE:
            return False
        self.line_ok = self.buf.find(b"\n", 0, MAX_REQUEST_LINE + 2) >= 0
        return not self.line_ok


class DropLog:
    """Counts dropped connections by reason; logs them as one warning per interval."""

    def __init__(
        self, on_drop: Callable[[str], None], interval: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.on_drop = on_drop
        self.interval = interval
        self.clock = clock
        self.pending: collections.Counter[str] = collections.Counter()
        self.latest = ""
        self.next_log = float("-inf")

    def drop(self, reason: str, addr: str) -> None:
        self.on_drop(reason)
        self.pending[reason] += 1
        self.latest = addr
        self.flush()

    def flush(self) -> None:
        now = self.clock()
        if not self.pending or now < self.next_log:
            return
        counts = ", ".join(f"{n} {r}" for r, n in sorted(self.pending.items()))
        log.warning(
            "dropped %d connection(s) to /metrics (%s), the latest from %s; counted in "
            "gpuwatch_web_connections_dropped_total, logged at most every %gs",
            sum(self.pending.values()),
            counts,
            self.latest,
            self.interval,
        )
        self.pending.clear()
        self.next_log = now + self.interval


def bind(family: socket.AddressFamily, address: tuple[str, int]) -> socket.socket:
    """A listening, non-blocking TCP socket; raises OSError (e.g. EADDRINUSE)."""
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            # "[::]:port" serves IPv4 too, like Go's listener; a specific v6 address does not.
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0 if address[0] == "::" else 1)
        sock.bind(address)
        sock.listen(BACKLOG)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def shutdown_socket(sock: socket.socket) -> None:
    # The plain socket's shutdown, also for an SSLSocket (no close_notify: the peer is hostile or
    # gone, and SSLSocket.shutdown() would block or raise on a non-blocking socket).
    with contextlib.suppress(OSError):
        socket.socket.shutdown(sock, socket.SHUT_RDWR)


def victim_of(waiting: Collection[Conn], now: float, grace: float) -> tuple[Conn | None, float | None]:
    """The waiting connection a newcomer replaces, or (None, when the first that may be ends
    its grace). By tier (``Conn.tier``): while one of a lower tier is in its grace, newcomers
    wait for it rather than push out a higher one (a reconnecting flood stays younger than
    the grace: it pushed out the scraper's keep-alive, 28 of 56 scrapes failed). Within a
    tier: the address holding most, the fewest answers, the one that began to wait first."""
    per_addr = collections.Counter(c.addr for c in waiting)
    best: Conn | None = None
    best_key: tuple[int, int, int, float] | None = None
    soonest: dict[int, float] = {}  # tier -> the first grace end in it
    for c in waiting:
        tier = c.tier()
        grace_end = c.since + grace
        if grace_end > now:
            soonest[tier] = min(soonest.get(tier, grace_end), grace_end)
            continue
        key = (tier, -per_addr[c.addr], c.served + c.answered, c.since)
        if best_key is None or key < best_key:
            best, best_key = c, key
    lower = [end for tier, end in soonest.items() if best_key is None or tier < best_key[0]]
    if lower:
        return None, min(lower)
    return best, (min(soonest.values()) if soonest else None)

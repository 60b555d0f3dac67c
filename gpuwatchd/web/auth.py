"""Basic-auth checks and per-client rate limits of the /metrics server, bounded so that no client,
with or without credentials, makes another wait (docs/security.md, N7).

``AuthChecker``: a bcrypt check (~65 ms at cost 10) runs on one thread of its own, one at a time
(exporter-toolkit runs them under one mutex), never in the listener's workers; its verdict,
success or failure, is cached per (user, password, hash), so a scraper whose password passed once
is answered from the cache (a dictionary lookup) however many checks wait, and a flood repeating
one wrong password costs one check. At most ``MAX_PENDING`` checks wait, at most
``PER_CLIENT`` of them from one client address; more are answered 503 at once.
``Buckets``: the web-config's ``rate_limit`` as one token bucket per client address (an IPv6
address by its /64), and one per (address, user) for requests whose credentials are already known
good, so a client flooding without credentials empties its own bucket, never the scraper's, even
from the scraper's address; at most ``MAX_CLIENTS`` buckets, the least recently used forgotten.

Cost: per cached verdict 32 bytes of key; per client a bucket; one thread once a password has to
be checked. Privilege: none. Imports bcrypt and hashlib (libcrypto) only when a web-config has
``basic_auth_users``. Shell equivalent: ``curl -u prometheus https://node:9958/metrics``.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable, Mapping

from gpuwatchd.web.web_config import RateLimit

log = logging.getLogger(__name__)

MAX_PENDING = 16
PER_CLIENT = 2
MAX_CLIENTS = 4096


def _verdict_key(users: Mapping[str, bytes], user: str, password: bytes) -> bytes:
    import hashlib  # here: only a web-config with basic_auth_users needs libcrypto

    hashed = users.get(user, b"")
    return hashlib.sha256(user.encode() + b"\0" + password + b"\0" + hashed).digest()


def _check(users: Mapping[str, bytes], user: str, password: bytes) -> bool:
    import bcrypt

    hashed = users.get(user)
    try:
        if hashed is None:
            # Checked against a configured user's hash anyway: an unknown user name costs the
            # same time as a wrong password, so timing does not reveal which users exist.
            bcrypt.checkpw(password, next(iter(users.values())))
            return False
        return bool(bcrypt.checkpw(password, hashed))
    except ValueError:  # a malformed hash, or a password bcrypt refuses (over 72 bytes)
        return False


class AuthChecker:
    """Cached bcrypt verdicts and the one thread that computes new ones."""

    def __init__(self, ok_size: int = 256, failed_size: int = 1024) -> None:
        # Two caches: a flood of wrong passwords can push out only other failures.
        self._ok: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._failed: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._sizes = (ok_size, failed_size)
        self._lock = threading.Lock()
        self._queue: collections.deque[tuple[Mapping[str, bytes], str, bytes, str, Callable[[bool], None]]] = (
            collections.deque()
        )
        self._pending: collections.Counter[str] = collections.Counter()
        self._cv = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self.checks = 0  # bcrypt checks run (tests)

    def cached(self, users: Mapping[str, bytes], user: str, password: bytes) -> bool | None:
        """The verdict already known for these credentials, or None."""
        key = _verdict_key(users, user, password)
        with self._lock:
            if key in self._ok:
                self._ok.move_to_end(key)
                return True
            if key in self._failed:
                return False
        return None

    def submit(
        self, users: Mapping[str, bytes], user: str, password: bytes, client: str, finish: Callable[[bool], None]
    ) -> bool:
        """Queue a check; ``finish(ok)`` is called on the auth thread. False: too many checks
        wait (from this client, or at all); nothing was queued."""
        with self._cv:
            if len(self._queue) >= MAX_PENDING or self._pending[client] >= PER_CLIENT:
                return False
            self._queue.append((users, user, password, client, finish))
            self._pending[client] += 1
            self._cv.notify()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="gpuwatchd-web-auth", daemon=True)
                try:
                    self._thread.start()
                except RuntimeError:  # no thread to be had (TasksMax=): refuse, as when full
                    self._thread = None
                    self._queue.pop()
                    self._pending[client] -= 1
                    return False
        return True

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue:
                    self._cv.wait()
                users, user, password, client, finish = self._queue.popleft()
            key = _verdict_key(users, user, password)
            with self._lock:
                known = True if key in self._ok else False if key in self._failed else None
            if known is None:
                known = _check(users, user, password)
                with self._lock:
                    self.checks += 1
                    cache = self._ok if known else self._failed
                    cache[key] = None
                    if len(cache) > self._sizes[0 if known else 1]:
                        cache.popitem(last=False)
            with self._cv:
                self._pending[client] -= 1
                if not self._pending[client]:
                    del self._pending[client]
            try:
                finish(known)
            except Exception:  # the isolation wrapper: finish() is guarded, this is its last line
                log.exception("answering after a password check failed")


def client_key(addr: str) -> str:
    """The rate limit's client: an IPv4 address, or an IPv6 address's /64."""
    if ":" not in addr or (addr.startswith("::ffff:") and "." in addr):
        return addr.removeprefix("::ffff:")
    with contextlib.suppress(OSError, ValueError):
        return socket.inet_pton(socket.AF_INET6, addr.split("%", 1)[0])[:8].hex() + "::/64"
    return addr


class Buckets:
    """One token bucket per client (``client_key``) for the web-config's ``rate_limit``."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._rate: RateLimit | None = None
        self._buckets: collections.OrderedDict[str, tuple[float, float]] = collections.OrderedDict()

    def take(self, rate: RateLimit | None, addr: str, user: str | None = None) -> bool:
        """A token for a request from ``addr``; ``user``: credentials already known good, whose
        requests have a bucket of their own, so that a flood without credentials from the same
        address (behind one NAT or proxy) cannot empty the scraper's."""
        if rate is None:
            return True
        key = client_key(addr) if user is None else f"{client_key(addr)}\0{user}"
        with self._lock:
            if rate != self._rate:  # a new rate_limit: every client starts with a full bucket
                self._rate = rate
                self._buckets.clear()
            now = self._clock()
            tokens, last = self._buckets.pop(key, (float(rate.burst), now))
            tokens = min(float(rate.burst), tokens + (now - last) / rate.interval_seconds)
            ok = tokens >= 1.0
            self._buckets[key] = (tokens - 1.0 if ok else tokens, now)
            if len(self._buckets) > MAX_CLIENTS:
                self._buckets.popitem(last=False)
            return ok

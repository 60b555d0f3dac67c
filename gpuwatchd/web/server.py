"""HTTP(S) server for ``/metrics``, configured like every Prometheus exporter.

Serves a registry (anything with ``collect()``: gpuwatchd's ``StateRegistry``, or a
prometheus_client ``CollectorRegistry``) over plain HTTP by default, or over TLS with
optional client certificates, bcrypt basic auth and a rate limit when given a web-config file in
the exporter-toolkit format (web/web_config.py, which also says how it is reloaded). Connections are
web/listener.py's, read with h11 (``web/request.py``); ``web/handler.py`` answers requests; this
module holds ``serve`` and
``WebServer.reload``.

Cost: connections are accepted, handshaken and read by one loop thread (web/listener.py), so
a waiting connection costs an fd and a small buffer, not a thread; complete requests are answered
by at most ``Limits.max_workers`` threads. A scrape costs what the registry's collectors cost
(gpuwatchd's collector only reads the latest NodeState, rendered once per cycle). bcrypt checks
(~70 ms at cost 10) run on one auth thread, their verdicts cached (web/auth.py).
Robustness: every connection has a deadline (``Limits``), at most ``Limits.max_connections`` are
open and a new one replaces the oldest waiting one, so slow, silent or garbage clients cost
bounded resources for a bounded time, never stop the server and never keep a scraper out.
Privilege: none (binding a port >= 1024).
Shell equivalent: ``curl --cacert ca.crt --cert client.crt --key client.key -u prometheus
https://node:9863/metrics``.
"""

from __future__ import annotations

import logging
import socket
from typing import Any

from gpuwatchd.config.checks import parse_listen_address
from gpuwatchd.counters import CounterStore
from gpuwatchd.exporter.families import Collector
from gpuwatchd.web.connection import DROP_REASONS, Limits, bind
from gpuwatchd.web.handler import Site
from gpuwatchd.web.listener import Listener
from gpuwatchd.web.web_config import (
    ConfigHolder,
)

log = logging.getLogger(__name__)


def _host_port(listen_address: str) -> tuple[str, int]:
    try:
        return parse_listen_address(listen_address)
    except ValueError as e:
        raise ValueError(f"listen address {listen_address!r}: {e}") from None


def _resolve(host: str, port: int) -> tuple[socket.AddressFamily, tuple[str, int]]:
    if host == "":
        if socket.has_ipv6:
            try:
                with socket.socket(socket.AF_INET6, socket.SOCK_STREAM):
                    return socket.AF_INET6, ("::", port)
            except OSError:
                pass
        return socket.AF_INET, ("0.0.0.0", port)
    # An ASCII name as bytes: a str is encoded with the idna codec, which imports unicodedata.
    name: str | bytes = host.encode("ascii") if host.isascii() else host
    infos = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, sockaddr = infos[0][0], infos[0][4]
    return family, (str(sockaddr[0]), int(sockaddr[1]))


class ListenError(OSError):
    """``serve`` cannot listen on the address (in use, not local, no such name); says which."""

    def __str__(self) -> str:
        return str(self.strerror)


class WebServer:
    """A running /metrics server; ``address`` is the (host, port) actually bound."""

    def __init__(
        self, listener: Listener, site: Site, requested: tuple[Any, ...], counters: CounterStore | None
    ) -> None:
        self._listener = listener
        self._site = site
        self._requested = requested
        self._counters = counters

    @property
    def address(self) -> tuple[str, int]:
        return self._listener.address

    @property
    def tls(self) -> bool:
        return self._site.tls() is not None

    @property
    def url(self) -> str:
        host, port = self.address
        shown = f"[{host}]" if ":" in host else host
        return f"{'https' if self.tls else 'http'}://{shown}:{port}/metrics"

    def close(self) -> None:
        self._listener.stop()

    def reload(self, listen_address: str, web_config_file: str | None) -> WebServer:
        """Serve with a new address or web-config, never losing the running server: the file is
        validated and a new address bound before the old one is given up. Returns the server now
        running (this one when the address is unchanged); raises like ``serve`` and then this
        server is untouched."""
        host, port = _host_port(listen_address)
        config = ConfigHolder(web_config_file)
        family, addr = _resolve(host, port)
        if (family, addr) == self._requested or addr == self.address:
            # Same address: the same socket serves on, under the new web-config; connections
            # accepted under other TLS settings are closed at their next request.
            self._site.config = config
            log.info("serving %s", self.url)
            return self
        new = _start(self._site.registry, family, addr, config, self._listener.limits, self._counters)
        self.close()
        return new


def _start(
    registry: Collector,
    family: socket.AddressFamily,
    addr: tuple[str, int],
    config: ConfigHolder,
    limits: Limits,
    counters: CounterStore | None,
) -> WebServer:
    sock = bind(family, addr)
    site = Site(registry, config)

    def dropped(reason: str) -> None:
        if counters is not None:
            counters.inc("web_connections_dropped", (reason,))

    listener = Listener(sock, limits, site.tls, site.san_allowed, site.serve, dropped)
    site.hand_back = listener.hand_back
    listener.start()
    ws = WebServer(listener, site, (family, addr), counters)
    log.info("serving %s", ws.url)
    return ws


def serve(
    registry: Collector,
    listen_address: str,
    web_config_file: str | None = None,
    limits: Limits | None = None,
    counters: CounterStore | None = None,
) -> WebServer:
    """Start serving ``registry`` on ``listen_address`` in background threads; connections
    dropped (see web/listener.py) are counted in ``counters`` when given.

    Raises ValueError for a bad address, WebConfigError for a bad web-config file, OSError when
    the address cannot be bound (ListenError, naming the address)."""
    host, port = _host_port(listen_address)
    config = ConfigHolder(web_config_file)
    try:
        family, addr = _resolve(host, port)
        if counters is not None:
            for reason in DROP_REASONS:
                counters.ensure("web_connections_dropped", (reason,))
        return _start(registry, family, addr, config, limits or Limits(), counters)
    except OSError as e:
        raise ListenError(e.errno, f"cannot listen on {listen_address}: {(e.strerror or str(e)).lower()}") from e

"""SIGHUP: re-read the config file and say what of it the daemon may apply at run time.

``reload_config`` is a plain function of what it reads: the running config, where the config comes
from (``ConfigSource``: the file and the command-line flags that override it) and the running web
server. It returns the new config and the server now serving (``Reloaded``), or None when it
refuses; ``Daemon.reload`` applies that. An invalid new config, a bad web-config or an address that
cannot be bound keeps the running config and server, and logs every problem. Costs one config-file
read (bounded by ``config.schema.MAX_CONFIG_BYTES``) per reload.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import time
from typing import TYPE_CHECKING

from gpuwatchd.config.checks import parse_listen_address
from gpuwatchd.config.schema import Config, ConfigError, load_config, with_overrides
from gpuwatchd.daemon.notify import notify
from gpuwatchd.web.web_config import WebConfigError

if TYPE_CHECKING:  # the server is imported when the daemon starts serving, not before
    from gpuwatchd.web.server import WebServer

log = logging.getLogger(__name__)
# Config sections that SIGHUP does not apply (the subsystems read them once, at start).
RESTART_SECTIONS = ("gil", "stall", "alertmanager", "nvml", "orphans", "kernel_log", "state_dir", "procfs", "straggler")


@dataclasses.dataclass(frozen=True)
class ConfigSource:
    """Where the daemon's config comes from: the file (None: only defaults, nothing to reload)
    and the command-line flags that override what it says."""

    path: str | None
    listen_override: str | None = None
    web_config_override: str | None = None


@dataclasses.dataclass(frozen=True)
class Reloaded:
    """An accepted reload: the config to run with and the web server now serving (the running
    one when its address and web-config are unchanged; None when the daemon serves nothing)."""

    config: Config
    web: WebServer | None


def reload_config(running: Config, source: ConfigSource, web: WebServer | None, *, started: bool) -> Reloaded | None:
    """Re-read ``source``. On any problem keep the running config and log why (None).

    ``started``: the daemon has finished a cycle, so systemd hears RELOADING=1 ... READY=1."""
    if source.path is None:
        log.info("SIGHUP: no config file to reload")
        return None
    # Type=notify-reload (systemd >= 253) holds `systemctl reload` open from RELOADING=1 to
    # READY=1; under Type=notify these only mark the unit "reloading" meanwhile. Not before
    # the first cycle: READY=1 would then announce a daemon that has not read anything yet.
    if started:
        notify(f"RELOADING=1\nMONOTONIC_USEC={time.monotonic_ns() // 1000}")
    try:
        return _reload(running, source.path, source, web)
    finally:
        if started:
            notify("READY=1")


def _reload(running: Config, path: str, source: ConfigSource, web: WebServer | None) -> Reloaded | None:
    try:
        new = with_overrides(load_config(path), source.listen_override, source.web_config_override)
        if new.web != running.web and web is not None:
            web = _reload_web(web, new, path)  # the last step that can fail
    except ConfigError as e:
        log.error("reload refused, keeping the running config:\n%s", e)
        notify(f"STATUS=reload refused: {len(e.problems)} problem(s) in {path}")
        return None
    # The subsystems (py-spy, kernel log, NVML, events) read their sections once, at start.
    later = [name for name in RESTART_SECTIONS if getattr(new, name) != getattr(running, name)]
    if later:
        log.warning(
            "configuration reloaded from %s; changes to %s take effect at the next restart", path, ", ".join(later)
        )
    else:
        log.info("configuration reloaded from %s", path)
    return Reloaded(new, web)


def _reload_web(web: WebServer, new: Config, path: str) -> WebServer:
    """The server for ``new.web``; the running one keeps serving when that is impossible
    (a bad web-config, an address in use): ConfigError then."""
    try:
        return web.reload(new.web.listen_address, new.web.config_file)
    except WebConfigError as e:
        raise ConfigError([f"web.config_file: {p}" for p in e.problems], e.path) from None
    except (OSError, ValueError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        if (
            isinstance(e, OSError)
            and e.errno == errno.EADDRINUSE
            and parse_listen_address(new.web.listen_address)[1] == web.address[1]
        ):
            why += " (by the running server: to move to an overlapping address, restart)"
        raise ConfigError(
            [f"web.listen_address: cannot listen on {new.web.listen_address}: {why}; still serving {web.url}"], path
        ) from None

"""SIGHUP: re-read the config file and apply what can change at run time (``Daemon`` inherits it).

An invalid new config, a bad web-config or an address that cannot be bound keeps the running
config and server, and logs every problem. Costs one config-file read (bounded by
``config.MAX_CONFIG_BYTES``) per reload.
"""

from __future__ import annotations

import errno
import logging
import time
from typing import Any

from gpuwatchd.config import Config, ConfigError, load_config, with_overrides
from gpuwatchd.daemon.notify import notify
from gpuwatchd.model import NodeState
from gpuwatchd.sources.rankfiles import RankFileReader
from gpuwatchd.web.config import WebConfigError

log = logging.getLogger("gpuwatchd")
# Config sections that SIGHUP does not apply (the subsystems read them once, at start).
RESTART_SECTIONS = ("gil", "stall", "alertmanager", "nvml", "orphans", "kernel_log", "state_dir",
                    "procfs", "straggler")


class ReloadMixin:
    """The reload path of ``Daemon``: what of the daemon it reads and replaces."""

    config: Config
    config_path: str | None
    listen_override: str | None
    web_config_override: str | None
    state: NodeState | None
    rankfiles: RankFileReader
    web: Any

    def _make_collectors(self) -> None:
        raise NotImplementedError

    def reload(self) -> bool:
        """Re-read the config file. On any problem keep the running config and log why."""
        if self.config_path is None:
            log.info("SIGHUP: no config file to reload")
            return False
        # Type=notify-reload (systemd >= 253) holds `systemctl reload` open from RELOADING=1 to
        # READY=1; under Type=notify these only mark the unit "reloading" meanwhile. Not before
        # the first cycle: READY=1 would then announce a daemon that has not read anything yet.
        started = self.state is not None
        if started:
            notify(f"RELOADING=1\nMONOTONIC_USEC={time.monotonic_ns() // 1000}")
        try:
            return self._reload()
        finally:
            if started:
                notify("READY=1")

    def _reload(self) -> bool:
        assert self.config_path is not None
        try:
            new = with_overrides(load_config(self.config_path), self.listen_override,
                                 self.web_config_override)
            if new.web != self.config.web and self.web is not None:
                self.web = self._reload_web(new)  # the last step that can fail
        except ConfigError as e:
            log.error("reload refused, keeping the running config:\n%s", e)
            notify(f"STATUS=reload refused: {len(e.problems)} problem(s) in {self.config_path}")
            return False
        old = self.config
        self.config = new
        if new.rank_dir != old.rank_dir:
            self.rankfiles = RankFileReader(new.rank_dir)
        if new.interval_seconds != old.interval_seconds:
            self._make_collectors()
        # The subsystems (py-spy, kernel log, NVML, events) read their sections once, at start.
        later = [name for name in RESTART_SECTIONS if getattr(new, name) != getattr(old, name)]
        if later:
            log.warning("configuration reloaded from %s; changes to %s take effect at the next "
                        "restart", self.config_path, ", ".join(later))
        else:
            log.info("configuration reloaded from %s", self.config_path)
        return True

    def _reload_web(self, new: Config) -> Any:
        """The server for ``new.web``; the running one keeps serving when that is impossible
        (a bad web-config, an address in use): ConfigError then."""
        from gpuwatchd.web import server as web

        try:
            return self.web.reload(new.web.listen_address, new.web.config_file)
        except WebConfigError as e:
            raise ConfigError([f"web.config_file: {p}" for p in e.problems], e.path) from None
        except (OSError, ValueError) as e:
            why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            if isinstance(e, OSError) and e.errno == errno.EADDRINUSE and \
                    web.parse_listen_address(new.web.listen_address)[1] == self.web.address[1]:
                why += " (by the running server: to move to an overlapping address, restart)"
            raise ConfigError([f"web.listen_address: cannot listen on {new.web.listen_address}:"
                               f" {why}; still serving {self.web.url}"],
                              self.config_path or "config") from None

"""Recovering from a device policy expanded before the NVIDIA driver registered.

When NVML fails, ``DevicePolicyGuard.diagnose()`` probes the /dev/nvidia* nodes NVML needs
(``sources.nvidia_devices``, at most once per ``probe_interval``, 15 s) and returns one line that
says exactly why they are denied, which becomes the nvml collector's error (so
``gpuwatch_collector_success{collector="nvml"}`` is 0 and the log, ``gpuwatchd ps --json`` and
the state file say why). When a restart would re-expand the unit's ``DeviceAllow=char-nvidia*``
(the denied majors are registered in /proc/devices now), ``restart_reason()`` asks the daemon to
exit with ``EXIT_REEXPAND`` (75, EX_TEMPFAIL) so that systemd's ``Restart=on-failure`` starts it
again with the policy expanded anew: no human needed.

Bounded: at most one such exit per boot and set of denied majors, remembered in
``state_dir/device-policy-restart`` (``<boot_id> <major,major,...>``). When the same majors are
still denied after that restart, something else denies them (a drop-in's DeviceAllow=, a
container's device cgroup): the daemon stays up, NVML stays down, and the log says so. A node
without NVIDIA nodes never probes anything and never exits.

Reads: the probe's files, state_dir's marker (a few bytes). Writes: the marker, once per exit.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

from gpuwatchd.sources.nvidia_devices import DeviceProbe, probe
from gpuwatchd.statefile import atomic_write

log = logging.getLogger(__name__)

EXIT_REEXPAND = 75  # EX_TEMPFAIL: "try again", for Restart=on-failure
MARKER = "device-policy-restart"


class DevicePolicyGuard:
    def __init__(
        self,
        state_dir: str,
        boot_id: str,
        *,
        probe_fn: Callable[[], DeviceProbe] = probe,
        probe_interval: float = 15.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.state_dir = state_dir
        self.boot_id = boot_id
        self.probe_fn = probe_fn
        self.probe_interval = probe_interval
        self.clock = clock
        self.last: DeviceProbe | None = None
        self._last_at = float("-inf")
        self._said_stuck = ""

    def diagnose(self) -> str:
        """After an NVML failure: "" when no NVIDIA node is denied, else why (one line)."""
        now = self.clock()
        if self.last is None or now - self._last_at >= self.probe_interval:
            self.last = self.probe_fn()
            self._last_at = now
        return self.last.explain()

    def _key(self, found: DeviceProbe) -> str:
        majors = ",".join(str(m) for m in sorted({n.major for n in found.restart_helps}))
        return f"{self.boot_id} {majors}"

    def restart_reason(self) -> str:
        """Why the daemon should exit for systemd to restart it now, or "" (see the module doc)."""
        found = self.last
        if found is None or not found.restart_helps:
            return ""
        key = self._key(found)
        if self._said_stuck == key:  # known, and said: no file read per cycle
            return ""
        path = os.path.join(self.state_dir, MARKER)
        try:
            with open(path, encoding="utf-8") as f:
                done = f.read(256).strip()
        except OSError:
            done = ""
        if done == key:
            if self._said_stuck != key:
                self._said_stuck = key
                log.error(
                    "NVIDIA devices still denied after the restart for them (%s): something "
                    "other than the policy's expansion at start denies them; check "
                    "DeviceAllow= in 'systemctl cat gpuwatchd' and its drop-ins. Not "
                    "restarting again this boot.",
                    found.explain(),
                )
            return ""
        try:
            os.makedirs(self.state_dir, exist_ok=True)
            atomic_write(path, key + "\n")
        except OSError as e:  # without the marker the bound cannot hold: do not exit
            log.error("cannot write %s (%s): not restarting for the NVIDIA device policy", path, e)
            return ""
        return (
            f"{found.explain()}. Exiting with status {EXIT_REEXPAND} so that systemd "
            f"restarts gpuwatchd and expands DeviceAllow=char-nvidia* again (once per boot)"
        )

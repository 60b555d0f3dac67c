"""Helpers to run the real daemon (`gpuwatchd run`) as a subprocess and scrape it over loopback."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parent.parent


def wakeups(tid: int, pid: int | None = None) -> int:
    """Voluntary context switches of thread ``tid`` (of ``pid``, default this process): how often
    it went to sleep and was woken, what the idle tests count."""
    with open(f"/proc/{pid or 'self'}/task/{tid}/status") as f:
        for line in f:
            if line.startswith("voluntary_ctxt_switches:"):
                return int(line.split()[1])
    raise AssertionError("no voluntary_ctxt_switches")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_config(tmp: Path, **overrides: Any) -> tuple[Path, dict[str, Any]]:
    cfg: dict[str, Any] = {
        "web": {"listen_address": f"127.0.0.1:{free_port()}"},
        "interval_seconds": 0.5,
        "rank_dir": str(tmp / "ranks"),
        "state_dir": str(tmp / "state"),
        "kernel_log": "off",
        "gil": {"enabled": False},
        "nvml": {"enabled": False},
        "discovery": {"enabled": False},
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    (tmp / "ranks").mkdir(exist_ok=True)
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, cfg


class DaemonProc:
    def __init__(
        self,
        config_path: Path,
        cfg: Mapping[str, Any],
        env: Mapping[str, str] | None = None,
        log_path: Path | None = None,
        args: Sequence[str] = (),
    ) -> None:
        self.cfg = cfg
        self.url = f"http://{cfg['web']['listen_address']}/metrics"
        self.log_path = log_path or config_path.with_suffix(".log")
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gpuwatchd", "run", "--config.file", str(config_path), *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            cwd=REPO,
        )
        try:
            self.wait_ready()
        except BaseException:
            self.stop()  # never leak a daemon from a failed start
            raise

    def wait_ready(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited {self.proc.returncode}:\n{self.log()}")
            try:
                if "gpuwatch_last_cycle_timestamp_seconds" in self.text():
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"daemon not ready:\n{self.log()}")

    def text(self) -> str:
        with urllib.request.urlopen(self.url, timeout=5) as r:
            return str(r.read().decode("utf-8"))

    def samples(self) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        out = {}
        for fam in text_string_to_metric_families(self.text()):
            for s in fam.samples:
                out[(s.name, frozenset(s.labels.items()))] = s.value
        return out

    def value(self, name: str, **labels: str) -> float | None:
        want = set(labels.items())
        for (n, ls), v in self.samples().items():
            if n == name and want <= set(ls):
                return v
        return None

    def wait_for(self, pred: Callable[[], bool], timeout: float = 15.0, what: str = "condition") -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if pred():
                return
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what}; daemon log:\n{self.log()}\nmetrics:\n{self.text()}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()
        return int(self.proc.returncode)


def has_finding(d: DaemonProc, kind: str, **labels: str) -> bool:
    return d.value("gpuwatch_finding", kind=kind, **labels) == 1.0


def finding_jobs(d: DaemonProc, kind: str) -> set[str]:
    """The job_ids that have a ``kind`` finding now. A daemon with discovery enabled watches every
    process of the host, so ranks of other tests' jobs (another suite running at the same time)
    show up beside a test's own: a test asks about its own jobs, never "no finding at all"."""
    return {
        dict(labels).get("job_id", "")
        for (name, labels), value in d.samples().items()
        if name == "gpuwatch_finding" and dict(labels).get("kind") == kind and value == 1.0
    }

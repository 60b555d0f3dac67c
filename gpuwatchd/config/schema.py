"""YAML configuration -> frozen dataclasses.

Every key is optional. Unknown keys and bad values are all reported at once, each with its dotted
path (``gil.rate_hz: must be a number > 0, got 'fast'``), so that an operator fixes a file in one
pass. ``gpuwatchd config check FILE`` runs exactly this code.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import yaml

from gpuwatchd.config import strict_yaml
from gpuwatchd.config.checks import (
    check_boolean,
    check_choice,
    check_instance,
    check_integer,
    check_label_value,
    check_launchers,
    check_listen,
    check_mapping,
    check_number,
    check_optional,
    check_path,
    check_url,
)

DEFAULT_PORT = 9863
MAX_CONFIG_BYTES = 1 << 20


class ConfigError(Exception):
    """Every problem of one config file; ``problems`` are ``"dotted.key: why"`` lines."""

    def __init__(self, problems: list[str], source: str = "config") -> None:
        self.problems = problems
        self.source = source
        super().__init__(f"{source}: " + "; ".join(problems))

    def __str__(self) -> str:
        lines = [f"{self.source}: {len(self.problems)} problem(s)"]
        lines += [f"  - {p}" for p in self.problems]
        return "\n".join(lines)


@dataclass(frozen=True)
class WebConfig:
    listen_address: str = f"0.0.0.0:{DEFAULT_PORT}"
    config_file: str | None = None


@dataclass(frozen=True)
class GilConfig:
    enabled: bool = True
    interval_seconds: float = 30.0
    duration_seconds: float = 5.0
    rate_hz: int = 50
    # a rank with no suspicious signal (daemon/gil_signals.py) gets a 1 s screening this often
    healthy_interval_seconds: float = 1800.0
    max_concurrent: int = 2
    held_threshold: float = 0.8
    pyspy_path: str | None = None
    timeout_seconds: float = 30.0


@dataclass(frozen=True)
class StallConfig:
    after_seconds: float = 300.0
    # the bound of the hangs whose evidence leaves no doubt (a lock-order deadlock, a GIL held at
    # one line, a GPU-confirmed spin, a stopped rank, a dead peer, the odd one out of a
    # collective: join/stall.py CONCLUSIVE_SECONDS); at most after_seconds
    conclusive_seconds: float = 40.0
    # a rank in torch.compile / Inductor / Triton autotuning with its CPU busy is "compiling", and
    # paged as stalled only after this long without progress (compiles of large models take long)
    compile_after_seconds: float = 1800.0
    # ask the ranks of a stalled job for their PyTorch flight-recorder dump (gpuwatchd/join/flight_recorder.py)
    flight_recorder: bool = True
    flight_recorder_interval_seconds: float = 60.0
    # ask NCCL's RAS port (NCCL >= 2.28) about a stalled, suspect or watched job (daemon/nccl_ras.py)
    nccl_ras: bool = True
    nccl_ras_interval_seconds: float = 10.0
    nccl_ras_timeout_seconds: float = 2.0


@dataclass(frozen=True)
class StragglerConfig:
    """rank_straggler: a rank whose step rate (heartbeat(step)) stays below ``ratio`` times its
    job's median on this node, measured over ``window_seconds``, for ``for_seconds``."""

    enabled: bool = True
    window_seconds: float = 300.0
    ratio: float = 0.8
    for_seconds: float = 300.0


@dataclass(frozen=True)
class AlertmanagerConfig:
    url: str | None = None
    timeout_seconds: float = 2.0
    # labels of pushed alerts that Prometheus would attach (so Alertmanager merges both paths):
    instance: str | None = None  # default: this host's name + web.listen_address's port; any
    # value Prometheus gives the node's series (a host name without the port, where relabelled)
    job: str = "gpuwatchd"  # the scrape job's name in prometheus.yml


@dataclass(frozen=True)
class NvmlConfig:
    enabled: bool = True
    timeout_seconds: float = 5.0
    fixture: str | None = None  # replay recorded readings instead of the driver (tests, demos)


@dataclass(frozen=True)
class OrphansConfig:
    grace_seconds: float = 60.0


@dataclass(frozen=True)
class DiscoveryConfig:
    enabled: bool = True
    interval_seconds: float = 30.0
    launchers: tuple[str, ...] = ("torchrun", "slurm", "openmpi")


@dataclass(frozen=True)
class FdsConfig:
    ratio_threshold: float = 0.9
    horizon_seconds: float = 3600.0
    # growth is measured over at least this long, so a start-up burst of opens is not a trend
    min_window_seconds: float = 120.0


@dataclass(frozen=True)
class MemoryConfig:
    """Host memory per rank (memory_subsystem.py) and the rank_memory_pressure finding."""

    enabled: bool = True
    ratio_threshold: float = 0.9  # working set / memory cgroup limit that raises the finding
    horizon_seconds: float = 900.0  # growth reaching the limit (or the node's end) this soon
    window_seconds: float = 300.0  # growth measured over this much history
    min_window_seconds: float = 60.0  # ... and over at least this long, so a burst is no trend
    cgroup_root: str | None = None  # where the cgroup file systems are (default /sys/fs/cgroup)
    snapshots_per_rank: int = 5  # py-spy evidence snapshots per rank process, at most
    snapshot_min_interval_seconds: float = 30.0  # between two snapshots of one rank


@dataclass(frozen=True)
class RetentionConfig:
    """How long the counter series of a rank outlive it (retention.py)."""

    # the GIL sample counters and the zero-valued OOM counters of a rank no longer registered
    ended_rank_seconds: float = 120.0
    # a non-zero OOM-kill / CUDA-OOM counter of such a rank: GPURankOOMKilled looks back 10m
    # (increase(...[10m]), offset 10m); 30 min leaves a restart or a slow rule evaluation room
    oom_kill_seconds: float = 1800.0


@dataclass(frozen=True)
class Config:
    web: WebConfig = field(default_factory=WebConfig)
    interval_seconds: float = 5.0
    rank_dir: str = "/run/gpuwatch/ranks"
    state_dir: str = "/var/lib/gpuwatchd"
    kernel_log: str = "auto"
    procfs: str = "/proc"
    log_level: str = "info"
    gil: GilConfig = field(default_factory=GilConfig)
    stall: StallConfig = field(default_factory=StallConfig)
    alertmanager: AlertmanagerConfig = field(default_factory=AlertmanagerConfig)
    nvml: NvmlConfig = field(default_factory=NvmlConfig)
    orphans: OrphansConfig = field(default_factory=OrphansConfig)
    discovery: DiscoveryConfig = field(default_factory=DiscoveryConfig)
    fds: FdsConfig = field(default_factory=FdsConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    retention: RetentionConfig = field(default_factory=RetentionConfig)
    straggler: StragglerConfig = field(default_factory=StragglerConfig)


SCHEMA: Mapping[str, Any] = {
    "web": (WebConfig, {"listen_address": check_listen, "config_file": check_optional(check_path)}),
    "interval_seconds": check_number(0.05, maximum=3600),
    "rank_dir": check_path,
    "state_dir": check_path,
    # YAML 1.1 reads an unquoted `off` as false: accept that spelling of "off"
    "kernel_log": lambda v: "off" if v is False else check_choice("auto", "journal", "kmsg", "off")(v),
    "procfs": check_path,
    "log_level": check_choice("debug", "info", "warning", "error"),
    "gil": (
        GilConfig,
        {
            "enabled": check_boolean,
            "interval_seconds": check_number(0.0),
            "healthy_interval_seconds": check_number(0.0, maximum=86400),
            "duration_seconds": check_number(0.0, maximum=600),
            "rate_hz": check_integer(1, 1000),
            "max_concurrent": check_integer(1, 64),
            "held_threshold": check_number(0.0, maximum=1.0),
            "pyspy_path": check_optional(check_path),
            "timeout_seconds": check_number(0.0, maximum=3600),
        },
    ),
    "stall": (
        StallConfig,
        {
            "after_seconds": check_number(0.0),
            "conclusive_seconds": check_number(0.0),
            "compile_after_seconds": check_number(0.0),
            "flight_recorder": check_boolean,
            "flight_recorder_interval_seconds": check_number(0.0),
            "nccl_ras": check_boolean,
            "nccl_ras_interval_seconds": check_number(0.0),
            "nccl_ras_timeout_seconds": check_number(0.05, maximum=30),
        },
    ),
    "alertmanager": (
        AlertmanagerConfig,
        {
            "url": check_optional(check_url),
            "timeout_seconds": check_number(0.0, maximum=60),
            "instance": check_optional(check_instance),
            "job": check_label_value,
        },
    ),
    "nvml": (
        NvmlConfig,
        {
            "enabled": check_boolean,
            "timeout_seconds": check_number(0.0, maximum=600),
            "fixture": check_optional(check_path),
        },
    ),
    "orphans": (OrphansConfig, {"grace_seconds": check_number(0.0, exclusive=False)}),
    "discovery": (
        DiscoveryConfig,
        {"enabled": check_boolean, "interval_seconds": check_number(0.0), "launchers": check_launchers},
    ),
    "memory": (
        MemoryConfig,
        {
            "enabled": check_boolean,
            "ratio_threshold": check_number(0.0, maximum=1.0),
            "horizon_seconds": check_number(0.0),
            "window_seconds": check_number(0.0, maximum=86400),
            "min_window_seconds": check_number(0.0, exclusive=False),
            "cgroup_root": check_optional(check_path),
            "snapshots_per_rank": check_integer(0, 100),
            "snapshot_min_interval_seconds": check_number(0.0, exclusive=False),
        },
    ),
    "straggler": (
        StragglerConfig,
        {
            "enabled": check_boolean,
            "window_seconds": check_number(0.0),
            "ratio": check_number(0.0, maximum=1.0),
            "for_seconds": check_number(0.0, exclusive=False),
        },
    ),
    "fds": (
        FdsConfig,
        {
            "ratio_threshold": check_number(0.0, maximum=1.0),
            "horizon_seconds": check_number(0.0),
            "min_window_seconds": check_number(0.0, exclusive=False),
        },
    ),
    "retention": (
        RetentionConfig,
        {
            "ended_rank_seconds": check_number(0.0, exclusive=False, maximum=86400),
            "oom_kill_seconds": check_number(0.0, exclusive=False, maximum=30 * 86400),
        },
    ),
}


def _build(cls: Any, schema: Mapping[str, Any], data: Any, prefix: str, problems: list[str]) -> Any:
    checks = dict(schema)
    for key, spec in schema.items():
        if isinstance(spec, tuple):  # a section: its own dataclass, built under its dotted key
            checks[key] = functools.partial(
                _build, spec[0], spec[1], prefix=f"{prefix}.{key}" if prefix else key, problems=problems
            )
    values = check_mapping(data, prefix, checks, problems)
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in values.items() if k in names})


def parse_config(data: Any, source: str = "config") -> Config:
    problems: list[str] = []
    cfg = _build(Config, SCHEMA, data, "", problems)
    if cfg.memory.min_window_seconds > cfg.memory.window_seconds:
        problems.append("memory.min_window_seconds: must not exceed memory.window_seconds")
    if cfg.gil.duration_seconds >= cfg.gil.timeout_seconds:
        problems.append("gil.timeout_seconds: must be larger than gil.duration_seconds")
    if cfg.gil.healthy_interval_seconds < cfg.gil.interval_seconds:
        problems.append("gil.healthy_interval_seconds: must be at least gil.interval_seconds")
    if cfg.retention.oom_kill_seconds < cfg.retention.ended_rank_seconds:
        problems.append("retention.oom_kill_seconds: must be at least retention.ended_rank_seconds")
    if problems:
        raise ConfigError(problems, source)
    assert isinstance(cfg, Config)
    return cfg


def load_config(path: str | None) -> Config:
    """Read and validate ``path`` (None: all defaults). Raises ConfigError with every problem."""
    if path is None:
        return Config()
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise ConfigError([f"cannot read: {e.strerror or e}"], path) from e
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError([f"larger than {MAX_CONFIG_BYTES} bytes"], path)
    try:
        text = raw.decode("utf-8")
        data = strict_yaml.load(text)
    except UnicodeDecodeError as e:
        raise ConfigError([f"not UTF-8 text: {e}"], path) from e
    except yaml.YAMLError as e:
        raise ConfigError([f"not valid YAML: {e}".replace("\n", " ")], path) from e
    return parse_config(data, path)


def with_overrides(cfg: Config, listen_address: str | None = None, web_config_file: str | None = None) -> Config:
    """Apply command-line flags, which win over the file (Prometheus exporter convention)."""
    if web_config_file is not None:
        cfg = dataclasses.replace(cfg, web=dataclasses.replace(cfg.web, config_file=web_config_file))
    if listen_address is not None:
        try:
            check_listen(listen_address)
        except ValueError as e:
            raise ConfigError([f"--web.listen-address: {e}"], "command line") from e
        cfg = dataclasses.replace(cfg, web=dataclasses.replace(cfg.web, listen_address=listen_address))
    return cfg

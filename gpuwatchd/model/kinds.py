"""The finding kinds and the alerts, as data: one row per kind, one row per alert.

Everything a kind is besides its rule's code lives in its row: its severity, the alert that
reports it, its runbook anchor, one line of what raises it, the rule module that raises it. The
registry (``findings.RULES``) is built from the rows, the finding-events part skips the kinds the
kernel log records already, the Alertmanager push path takes its alert name, summary and runbook
from here; and tests/test_finding_kinds.py checks the rest against the rows: the rule modules'
``Finding`` calls, docs/metrics.md's "Finding kinds" table, the README's list, the anchors of
docs/runbooks.md and the alert rules of deploy/prometheus/gpuwatchd.rules.yml. A kind added here
and not there (or there and not here) fails that test. Adding a finding: docs/architecture.md.

Kept in ``model`` so that every layer may read it: the event log (``events``) sits below
``findings``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from gpuwatchd.model import INFO, PAGE, WARNING, frozen_map

FINDING_SERIES = "gpuwatch_finding"


@dataclass(frozen=True)
class Alert:
    """One alert of deploy/prometheus/gpuwatchd.rules.yml. ``severity`` is the monitoring
    mixins' word (critical pages, warning is a ticket, info is for dashboards); ``summary`` is the
    rule's static sentence, which the push path sends too; the runbook anchor is the lower-cased
    name. ``per_rank``: it fires per rank, with the series' ``job_id``, ``rank`` and ``instance``."""

    name: str
    severity: str
    summary: str
    per_rank: bool = False

    @property
    def anchor(self) -> str:
        return self.name.lower()


@dataclass(frozen=True)
class FindingKind:
    """One kind of finding.

    ``severity`` is the finding's own word (page, warning, info: ``gpuwatch_finding{severity}``).
    ``alert`` is the alert that reports the condition ("" for none) and ``series`` what that alert
    selects: ``gpuwatch_finding{kind=...}`` itself, or another series that carries the same
    condition (an OOM kill is a counter). ``runbook`` is an anchor in docs/runbooks.md. ``line``
    is what raises it, in one line: docs/metrics.md's "raised when" starts with it. ``rule`` is
    the module ``gpuwatchd/findings/<rule>.py`` that raises it (its name is the kind's, unless it
    raises several kinds). ``late``: the rule reads the other rules' findings, so it runs after
    them. ``event``: the kernel-log event that records the condition already (its transitions are
    not logged again, and the push path sends that event under ``alert``)."""

    kind: str
    severity: str
    alert: str
    runbook: str
    line: str
    rule: str
    series: str = FINDING_SERIES
    late: bool = False
    event: str = ""


ALERTS: tuple[Alert, ...] = (
    Alert(
        "GPURankOOMKilled", "critical", "A rank of a training job was killed for lack of host memory.", per_rank=True
    ),
    Alert("GPURankDown", "critical", "A registered rank of a training job has exited.", per_rank=True),
    Alert("GPUJobCrashed", "warning", "A training job crashed by its own code.", per_rank=True),
    Alert("GPURankStalled", "critical", "A rank of a training job makes no progress.", per_rank=True),
    Alert(
        "GPURankFDExhaustion", "warning", "A rank of a training job is running out of file descriptors.", per_rank=True
    ),
    Alert("GPURankMemoryPressure", "warning", "A rank of a training job is running out of host memory.", per_rank=True),
    Alert("GPURankGILSaturated", "warning", "A rank of a training job is bound by the Python GIL.", per_rank=True),
    Alert("GPURankStraggler", "warning", "A rank is much slower than the other ranks of its job.", per_rank=True),
    Alert("GPURankMisconfigured", "info", "A training job runs with a setting that makes it fragile."),
    Alert("GPUXidCritical", "critical", "A GPU failed: a critical Xid error, or it left the PCI bus."),
    Alert("GPUMemoryHeldByOrphan", "warning", "GPU memory is held by a process of no live job."),
    Alert("GpuwatchdCollectorFailing", "warning", "A gpuwatchd collector keeps failing."),
    Alert("GpuwatchdDown", "warning", "Prometheus cannot scrape gpuwatchd."),
    Alert("GpuwatchdCycleStopped", "warning", "The gpuwatchd daemon has stopped finishing cycles."),
    Alert("GpuwatchdMemoryHigh", "warning", "The gpuwatchd daemon uses most of its memory limit."),
    # a refused reload (SIGHUP, a ConfigMap changed under the pod) leaves the old config running,
    # silently but for one log line: the mixins' PrometheusBadConfig / AlertmanagerFailedReload
    Alert("GpuwatchdConfigReloadFailed", "warning", "The gpuwatchd daemon refused to reload its configuration."),
)

# In the order the rules run (the order of gpuwatch_finding's samples and of `gpuwatchd ps`).
KINDS: tuple[FindingKind, ...] = (
    FindingKind(
        "rank_down",
        PAGE,
        "GPURankDown",
        "gpurankdown",
        "a rank died and its death pages by cause and consequence",
        "rank_down",
    ),
    FindingKind(
        "fd_exhaustion",
        WARNING,
        "GPURankFDExhaustion",
        "gpurankfdexhaustion",
        "open fds ≥ 90 % of the soft limit, or growing to reach it within 1 h",
        "fd_exhaustion",
    ),
    FindingKind(
        "nccl_legacy_env",
        INFO,
        "GPURankMisconfigured",
        "gpurankmisconfigured",
        "a renamed NCCL variable that PyTorch ignores is set",
        "nccl_env",
    ),
    FindingKind(
        "nccl_error_handling_off",
        WARNING,
        "GPURankMisconfigured",
        "gpurankmisconfigured",
        "`TORCH_NCCL_ASYNC_ERROR_HANDLING=0`",
        "nccl_env",
    ),
    FindingKind(
        "bad_rank_file",
        INFO,
        "GPURankMisconfigured",
        "gpurankmisconfigured",
        "a rank file was refused (invalid, untrusted, symlink, too large, ...)",
        "bad_rank_file",
    ),
    FindingKind(
        "gil_saturated",
        WARNING,
        "GPURankGILSaturated",
        "gpurankgilsaturated",
        "the GIL-held ratio stays high while the GPU waits",
        "gil_saturated",
    ),
    FindingKind(
        "rank_stalled",
        PAGE,
        "GPURankStalled",
        "gpurankstalled",
        "a live rank made no progress for `stall.after_seconds`",
        "stall",
        series="gpuwatch_rank_stalled",
    ),
    FindingKind(
        "rank_stall_unconfirmed",
        WARNING,
        "",
        "rank_stall_unconfirmed",
        "no heartbeat and the same stack in every dump for `stall.after_seconds`, but a Python "
        "thread burns a core at that line and nothing confirms a stall",
        "stall",
    ),
    FindingKind(
        "rank_waiting",
        INFO,
        "",
        "rank_waiting",
        "a rank that would be stalled waits in a collective or on its GPU while a peer of its job progresses",
        "stall",
    ),
    FindingKind(
        "rank_compiling",
        INFO,
        "",
        "gpurankstalled",
        "no progress for `stall.after_seconds`, but in torch.compile / Inductor / Triton frames with the CPU busy",
        "stall",
    ),
    FindingKind(
        "rank_oom_killed",
        PAGE,
        "GPURankOOMKilled",
        "gpurankoomkilled",
        "a rank (or a process of its tree) was killed by an OOM killer",
        "rank_oom_killed",
        series="gpuwatch_oom_kills_total",
        event="oom_kill",
    ),
    FindingKind(
        "xid_critical",
        PAGE,
        "GPUXidCritical",
        "gpuxidcritical",
        "an Xid that kills work or needs a GPU reset",
        "xid_critical",
        series="gpuwatch_gpu_xid_errors_total",
        event="xid",
    ),
    FindingKind(
        "gpu_lost", PAGE, "GPUXidCritical", "gpuxidcritical", "a GPU fell off the bus / disappeared", "gpu_lost"
    ),
    FindingKind(
        "orphan_gpu_memory",
        WARNING,
        "GPUMemoryHeldByOrphan",
        "gpumemoryheldbyorphan",
        "GPU memory held by a process in no live job",
        "orphan_gpu_memory",
        series="gpuwatch_orphan_gpu_memory_bytes",
    ),
    FindingKind(
        "fork_after_cuda",
        WARNING,
        "GPURankMisconfigured",
        "gpurankmisconfigured",
        "a child forked from a rank after CUDA was initialised",
        "fork_after_cuda",
    ),
    FindingKind(
        "rank_memory_pressure",
        WARNING,
        "GPURankMemoryPressure",
        "gpurankmemorypressure",
        "the working set of a rank's memory cgroup is ≥ `memory.ratio_threshold` (90 %) of its limit",
        "rank_memory_pressure",
    ),
    FindingKind("cuda_oom", WARNING, "", "cuda_oom", "a rank hit CUDA out-of-memory", "cuda_oom"),
    FindingKind(
        "job_crashed",
        WARNING,
        "GPUJobCrashed",
        "gpujobcrashed",
        "the first rank of a job to fail on this node ended by its own code",
        "job_crashed",
    ),
    FindingKind(
        "job_crash_loop",
        WARNING,
        "",
        "job_crash_loop",
        "a job's ranks on this node failed 3 times or more within 10 minutes, restarted by its launcher each time",
        "job_crash_loop",
    ),
    FindingKind(
        "nccl_rank_missing",
        WARNING,
        "",
        "nccl_rank_missing",
        "NCCL RAS, asked because a rank of the job is stalled, suspect, late with its "
        "heartbeat or waiting in a collective, names a rank the job waits for",
        "nccl_rank_missing",
    ),
    FindingKind(
        "rank_straggler",
        WARNING,
        "GPURankStraggler",
        "gpurankstraggler",
        "the rank's step rate (`heartbeat(step)`) stays below `straggler.ratio` x its job's "
        "median on this node for `straggler.for_seconds`",
        "rank_straggler",
        series="gpuwatch_rank_step",
        late=True,
    ),
)

KIND: Mapping[str, FindingKind] = frozen_map({k.kind: k for k in KINDS})
ALERT: Mapping[str, Alert] = frozen_map({a.name: a for a in ALERTS})
# The kinds the kernel log records as events of their own (oom_kill, xid).
EVENT_KINDS: frozenset[str] = frozenset(k.kind for k in KINDS if k.event)


def rule_modules(late: bool = False) -> tuple[str, ...]:
    """The rule modules, each once, in the order of their first row (``late``: those that read
    the other rules' findings)."""
    return tuple(dict.fromkeys(k.rule for k in KINDS if k.late == late))

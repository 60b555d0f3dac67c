"""Rank-file trust with a real second user, through the real daemon.

The rank directory is world-writable (1777, like /tmp), so any local user can drop files there.
Each attack below is performed by that user, as that user (setpriv), with a real process of root's
and one of the user's own; the daemon must accept only what the user may claim, report every
refusal as a bad_rank_file finding, and keep its /metrics bounded and well-formed."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemonutil import DaemonProc, write_config
from userutil import as_user, rank_world_fixture, user_writes, users_fixture

from gpuwatchd.join.state import select_entries
from gpuwatchd.model import RankEntry
from gpuwatchd.paths import HostPaths
from gpuwatchd.rank.rankfile import MAX_RANKS_PER_JOB
from gpuwatchd.sources.heartbeats import heartbeat_mtime
from gpuwatchd.sources.procfs import ProcfsReader
from gpuwatchd.sources.rankfiles import RankFileReader, cap_ranks, guard_entries


def _beat(entry: RankEntry) -> float | None:
    """The heartbeat mtime the daemon would use: guarded as in a cycle, then read."""
    [guarded], _ = guard_entries([entry])
    return heartbeat_mtime(guarded)


USER = "gw-h7-trust"


user = users_fixture(USER)


world = rank_world_fixture("gw-h7-trust-")


def _as_user(*argv: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return as_user(USER, *argv, stdin=stdin)


def _user_writes(path: Path, content: str) -> None:
    user_writes(USER, path, content)


def _doc(job: str, ranks: list[dict[str, object]]) -> str:
    return json.dumps({"version": 1, "job_id": job, "ranks": ranks})


@pytest.fixture
def processes(user: int) -> Iterator[tuple[int, int]]:
    """(root's process, the user's process), both alive for the test."""
    root_proc = subprocess.Popen(["/usr/bin/python3", "-c", "import time; time.sleep(300)"])
    user_proc = subprocess.Popen(
        [
            "setpriv",
            f"--reuid={USER}",
            f"--regid={USER}",
            "--clear-groups",
            "/usr/bin/python3",
            "-c",
            "import time; time.sleep(300)",
        ],
        env={"PATH": "/usr/bin:/bin"},
    )
    yield root_proc.pid, user_proc.pid
    for p in (root_proc, user_proc):
        p.kill()
        p.wait(10)


def test_rank_file_attacks_by_a_second_user(user: int, world: Path, processes: tuple[int, int]) -> None:
    root_pid, user_pid = processes
    ranks = world / "ranks"

    # 1. Honest: the user registers their own process, with a heartbeat file they own.
    _user_writes(world / "ranks" / "hb-own", "")
    _user_writes(
        ranks / "honest.json", _doc("honest", [{"rank": 0, "pid": user_pid, "heartbeat": str(ranks / "hb-own")}])
    )
    # 2. Claiming root's process.
    _user_writes(ranks / "steal.json", _doc("steal", [{"rank": 0, "pid": root_pid}]))
    # 3. A symlink to a root-owned rank file (which would be trusted for root's process).
    private = world / "private"
    private.mkdir(mode=0o755)
    (private / "root.json").write_text(_doc("rootjob", [{"rank": 0, "pid": root_pid}]))
    out = _as_user("/bin/ln", "-s", str(private / "root.json"), str(ranks / "link.json"))
    assert out.returncode == 0, out.stderr
    # 4. Hard links: the kernel stops a link to root's file (fs.protected_hardlinks=1); a second
    #    name for one's own file is refused by the daemon (a link count above 1 is never trusted).
    if Path("/proc/sys/fs/protected_hardlinks").read_text().strip() == "1":
        out = _as_user("/bin/ln", str(private / "root.json"), str(ranks / "hard-root.json"))
        assert out.returncode != 0 and not (ranks / "hard-root.json").exists()
    home = world / "home"
    home.mkdir()
    os.chown(home, user, -1)
    _user_writes(home / "mine.json", _doc("hardlink", [{"rank": 0, "pid": user_pid}]))
    out = _as_user("/bin/ln", str(home / "mine.json"), str(ranks / "hard.json"))
    assert out.returncode == 0, out.stderr
    # 5. Oversized and deeply nested documents.
    _user_writes(
        ranks / "huge.json", _doc("huge", [{"rank": 0, "pid": user_pid}])[:-1] + ', "x": "' + "A" * 300_000 + '"}'
    )
    _user_writes(ranks / "deep.json", "[" * 100_000 + "]" * 100_000)
    # 6. Label injection through job_id, and a job_id far too long.
    _user_writes(ranks / "inject.json", _doc('x",kind="rank_oom_killed', [{"rank": 0, "pid": user_pid}]))
    _user_writes(ranks / "long.json", _doc("j" * 129, [{"rank": 0, "pid": user_pid}]))
    # 7. A heartbeat path pointing at a root file: its mtime must not leak into /metrics.
    secret = private / "root-only"
    secret.write_text("x")
    secret.chmod(0o600)
    os.utime(secret, (1_000_000_000, 1_000_000_000))
    _user_writes(ranks / "peek.json", _doc("peek", [{"rank": 0, "pid": user_pid, "heartbeat": str(secret)}]))
    # 8. A flood: one job claiming more ranks than the per-job cap.
    n_flood = MAX_RANKS_PER_JOB + 44
    _user_writes(ranks / "flood.json", _doc("flood", [{"rank": i, "pid": 4_000_000 + i} for i in range(n_flood)]))

    path, cfg = write_config(world, rank_dir=str(ranks))
    d = DaemonProc(path, cfg)
    try:
        # /metrics shows a cycle's state before that cycle has written state.json: wait for both
        d.wait_for(
            lambda: (
                d.value("gpuwatch_rank_up", job_id="honest", rank="0") == 1.0
                and (world / "state" / "state.json").exists()
            ),
            what="the honest rank",
        )
        samples = d.samples()
        text = d.text()
        state = json.loads((world / "state" / "state.json").read_text())
    finally:
        d.stop()

    def series(name: str, job: str) -> list[dict[str, str]]:
        return [dict(ls) for (n, ls), _ in samples.items() if n == name and dict(ls).get("job_id") == job]

    def progress(job: str) -> list[float]:
        return [
            v
            for (n, ls), v in samples.items()
            if n == "gpuwatch_rank_progress_timestamp_seconds" and dict(ls)["job_id"] == job
        ]

    # Accepted: the honest rank, its heartbeat (the user's own file) and the capped flood.
    assert series("gpuwatch_rank_info", "honest")[0]["pid"] == str(user_pid)
    assert progress("honest") == [(ranks / "hb-own").stat().st_mtime]
    assert len(series("gpuwatch_rank_up", "flood")) == MAX_RANKS_PER_JOB
    # Refused: nothing of these jobs reaches /metrics.
    for job in ("steal", "rootjob", "hardlink", "huge", "j" * 129):
        assert series("gpuwatch_rank_info", job) == [], job
    assert 'job_id="x' not in text and "rank_oom_killed" not in text
    # The peek rank is accepted (the user's own process) but the root file's mtime is not shown.
    assert series("gpuwatch_rank_info", "peek") != []
    assert 1_000_000_000.0 not in progress("peek")  # at most the daemon's own progress guess
    # the value 1e9 itself, as either format writes it, not a digit run inside another number
    # (floatToGoString writes a real timestamp as 1.79616597556067...51e+09)
    assert not re.search(r"(?<![\d.])(?:1000000000(?:\.0)?|1e\+09)(?![\d.])", text)

    # Every refusal is a finding with its reason.
    explanations = "\n".join(f["explanation"] for f in state["findings"] if f["kind"] == "bad_rank_file")
    expected = {
        "steal.json": f"may not claim pid {root_pid}",
        "link.json": "symbolic link",
        "hard.json": "hard links",
        "huge.json": "larger than",
        "deep.json": "nested deeper",
        "inject.json": "job_id must be",
        "long.json": "job_id must be",
        "flood.json": f"more than {MAX_RANKS_PER_JOB} ranks",
    }
    for name, reason in expected.items():
        assert any(name in line and reason in line for line in explanations.splitlines()), (name, reason, explanations)
    # On /metrics they share one series (a bad file has no job_id/rank/pid label to tell apart).
    assert [v for (n, ls), v in samples.items() if n == "gpuwatch_finding" and dict(ls)["kind"] == "bad_rank_file"] == [
        1.0
    ]

    # The exposition stays valid with all of this on it.
    promtool = shutil.which("promtool")
    assert promtool is not None
    lint = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert "error" not in (lint.stdout + lint.stderr).lower(), lint.stdout + lint.stderr


def test_trust_is_rechecked_when_the_pid_changes_hands(user: int, world: Path, processes: tuple[int, int]) -> None:
    """A user's file naming a PID that does not exist yet proves nothing; once a root process
    holds that PID, the claim is refused (the owner check runs every cycle)."""
    root_pid, _ = processes
    reader = RankFileReader(str(world / "ranks"))
    _user_writes(world / "ranks" / "later.json", _doc("later", [{"rank": 0, "pid": root_pid}]))
    entries, bad = reader.scan()
    assert bad == [] and [e.owner_uid for e in entries] == [user]
    procs = ProcfsReader(HostPaths()).read_many([root_pid])
    accepted, refused = select_entries(tuple(entries), procs)
    assert accepted == [] and "may not claim" in refused[0].reason
    accepted, refused = select_entries(tuple(entries), {})
    assert [e.job_id for e in accepted] == ["later"] and refused == []


def test_cap_ranks_per_owner_and_per_job() -> None:
    def e(job: str, rank: int, owner: int | None, source: str = "rankfile") -> RankEntry:
        return RankEntry(
            job_id=job, rank=rank, pid=10_000 + rank, source=source, path=f"/r/{job}.json", owner_uid=owner
        )

    many = [e(f"j{j}", r, 1234) for j in range(5) for r in range(250)]
    kept, bad = cap_ranks(many, per_job=256, per_owner=1024)
    assert len(kept) == 1024 and len(bad) == 1 and "uid 1234" in bad[0].reason
    root = [e("big", r, 0) for r in range(300)]
    kept, bad = cap_ranks(root, per_job=256, per_owner=1024)
    assert len(kept) == 256 and [r.rank for r in kept] == list(range(256))
    assert "job big claims more than 256 ranks" in bad[0].reason
    disc = [e("env", r, None, source="environ") for r in range(10)]
    kept, bad = cap_ranks(disc, per_job=4)
    assert len(kept) == 4 and bad[0].path == "/r/env.json"
    kept, bad = cap_ranks([e("a", 0, 5)], [])
    assert len(kept) == 1 and bad == []


def test_heartbeat_owner_rule(user: int, world: Path, processes: tuple[int, int]) -> None:
    _, user_pid = processes
    own = world / "ranks" / "own.hb"
    _user_writes(own, "")
    root_file = world / "root.hb"
    root_file.write_text("")
    entry = RankEntry(job_id="j", rank=0, pid=user_pid, heartbeat=str(own), owner_uid=user, source="rankfile")
    assert _beat(entry) == own.stat().st_mtime
    peek = RankEntry(job_id="j", rank=0, pid=user_pid, heartbeat=str(root_file), owner_uid=user, source="rankfile")
    assert _beat(peek) is None
    by_root = RankEntry(job_id="j", rank=0, pid=user_pid, heartbeat=str(root_file), owner_uid=0, source="rankfile")
    assert _beat(by_root) == root_file.stat().st_mtime
    # Resolved in the rank's mount namespace: a path only the rank's /proc/PID/root shows.
    gone = RankEntry(job_id="j", rank=0, pid=user_pid, heartbeat="/nonexistent/x.hb", owner_uid=user, source="rankfile")
    assert _beat(gone) is None


def test_heartbeat_is_found_in_the_ranks_own_mount_namespace(tmp_path: Path) -> None:
    """The daemon runs with PrivateTmp=yes, so a heartbeat in the job's /tmp is not in its own
    view; heartbeat_path resolves it through /proc/PID/root. Here the rank lives in a private
    mount namespace whose tmpfs holds the heartbeat, invisible from the test's namespace."""
    hidden = tmp_path / "job-tmp"
    hidden.mkdir()
    rank = subprocess.Popen(
        [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            f"mount -t tmpfs gw-h7 {hidden} && touch -d @1700000000 {hidden}/hb && echo ok && exec sleep 120",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert rank.stdout is not None and rank.stdout.readline().strip() == "ok"
        assert not (hidden / "hb").exists()  # not in our view
        entry = RankEntry(
            job_id="ns", rank=0, pid=rank.pid, heartbeat=str(hidden / "hb"), owner_uid=0, source="rankfile"
        )
        [guarded], bad = guard_entries([entry])
        assert bad == [] and guarded.heartbeat_root == f"/proc/{rank.pid}/root"
        assert heartbeat_mtime(guarded) == 1_700_000_000.0
    finally:
        rank.kill()
        rank.wait(10)


def test_heartbeat_links_never_leave_the_ranks_root(tmp_path: Path) -> None:
    """A rank in its own root (chroot, as in a container) whose heartbeat path is a symlink: an
    absolute target or a run of '..' is resolved inside that root, never in the daemon's tree
    (where a plain stat of /proc/PID/root/... would find it)."""
    root = tmp_path / "croot"
    root.mkdir()
    (root / "hb").write_text("")
    os.utime(root / "hb", (1_700_000_000, 1_700_000_000))
    outside = tmp_path / "daemon-only"
    outside.write_text("")
    os.utime(outside, (1_600_000_000, 1_600_000_000))
    (root / "inner").symlink_to("/hb")
    (root / "escape").symlink_to(outside)
    (root / "dotdot").symlink_to("../" * 20 + str(outside).lstrip("/"))
    rank = subprocess.Popen(
        [
            "/usr/bin/python3",
            "-c",
            "import os, sys, time; os.chroot(sys.argv[1]); os.chdir('/'); print('ok', flush=True); time.sleep(120)",
            str(root),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert rank.stdout is not None and rank.stdout.readline().strip() == "ok"
        assert os.stat(f"/proc/{rank.pid}/root/escape").st_mtime == 1_600_000_000.0  # the hole

        def beat(path: str) -> float | None:
            return _beat(
                RankEntry(job_id="c", rank=0, pid=rank.pid, heartbeat=path, owner_uid=0, ns_pid=1, source="rankfile")
            )

        assert beat("/hb") == beat("/inner") == 1_700_000_000.0
        assert beat("/escape") is None and beat("/dotdot") is None
        assert beat("/../../hb") == 1_700_000_000.0  # '..' stops at the rank's root
    finally:
        rank.kill()
        rank.wait(10)

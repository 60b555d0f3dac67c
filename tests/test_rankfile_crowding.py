"""Issue 23 N1 and N5: one user's rank files never crowd out another's, and ``gpuwatchd check``
applies the daemon's trust rules. Real second and third users (useradd, setpriv), real processes,
the real daemon and the real ``check`` (NVML replayed from the H200 recording with its one holder
mapped onto a real process).

- N1: 4097 empty files of U1 (``!00000.json`` ..., sorted before everyone else's) took the
  first 4096 places of the reader's cap: every other rank vanished from /metrics with
  ``collector_success`` 1, and ``check --kill`` SIGTERMed U2's registered live rank.
- N5: U1's file claiming U2's unregistered GPU holder made ``check`` say ``clean``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from daemonutil import DaemonProc, finding_jobs, write_config
from userutil import as_user, rank_world_fixture, setpriv, user_writes, users_fixture

from gpuwatchd.cli import check
from gpuwatchd.config.schema import load_config
from gpuwatchd.rank.rankfile import MAX_FILES, MAX_FILES_PER_OWNER, MAX_RANKS_PER_NODE
from gpuwatchd.sources.nvml import NvmlSource
from gpuwatchd.sources.nvml_fixture import RecordedNvml
from gpuwatchd.sources.rankfiles import RankFileReader

U1, U2 = "gw-crowd-u1", "gw-crowd-u2"
SLEEP = ["/usr/bin/python3", "-c", "import time; time.sleep(300)"]
H200 = Path(__file__).parent / "fixtures" / "nvml" / "h200_orphan_dataloader.json"
HOLDER = 447  # the recorded PID of the one GPU holder kept in the fixture below
JUNK = (
    "import sys\nfor i in range(int(sys.argv[2])):\n"
    "    open(f'{sys.argv[1]}/!{sys.argv[3]}{i:05d}.json', 'w').close()\n"
)


users = users_fixture(U1, U2)


world = rank_world_fixture("gw-crowd-")


def _popen_as(user: str, procs: list[subprocess.Popen[Any]]) -> subprocess.Popen[Any]:
    p = subprocess.Popen([*setpriv(user), *SLEEP], env={"PATH": "/usr/bin:/bin"})
    procs.append(p)
    return p


def _doc(job: str, pid: int) -> str:
    return json.dumps({"version": 1, "job_id": job, "ranks": [{"rank": 0, "pid": pid}]})


def _junk(user: str | None, ranks: Path, n: int) -> None:
    """``n`` empty ``!USERNNNNN.json`` files (names that sort before any other) owned by ``user``."""
    argv = ["/usr/bin/python3", "-c", JUNK, str(ranks), str(n), user or "root"]
    out = as_user(user, *argv) if user else subprocess.run(argv, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_one_users_junk_crowds_out_nobody(
    users: tuple[int, int], world: Path, procs: list[subprocess.Popen[Any]]
) -> None:
    u1, _ = users
    ranks = world / "ranks"
    job = f"crowd{os.getpid()}"
    root_rank = subprocess.Popen(SLEEP)
    procs.append(root_rank)
    u2_rank = _popen_as(U2, procs)
    (ranks / "root.json").write_text(_doc(f"{job}-root", root_rank.pid))
    user_writes(U2, ranks / "u2.json", _doc(f"{job}-u2", u2_rank.pid))
    _junk(U1, ranks, MAX_FILES + 1)

    path, cfg = write_config(world, rank_dir=str(ranks))
    d = DaemonProc(path, cfg)
    try:
        d.wait_for(
            lambda: (
                d.value("gpuwatch_rank_up", job_id=f"{job}-root", rank="0") == 1.0
                and d.value("gpuwatch_rank_up", job_id=f"{job}-u2", rank="0") == 1.0
            ),
            what="root's and U2's ranks up beside U1's 4097 files",
        )
        # the others' files were all read: the collector is up, U1's excess is named
        assert d.value("gpuwatch_collector_success", collector="rankfiles") == 1.0
        state = json.loads((world / "state" / "state.json").read_text())
        told = [
            f["explanation"]
            for f in state["findings"]
            if f["kind"] == "bad_rank_file" and f"uid {u1} has {MAX_FILES + 1} rank files" in f["explanation"]
        ]
        assert told and f"{MAX_FILES + 1 - MAX_FILES_PER_OWNER} ignored" in told[0], told
        root_rank.kill()
        root_rank.wait()
        d.wait_for(lambda: f"{job}-root" in finding_jobs(d, "rank_down"), what="rank_down of root's rank")
    finally:
        d.stop()


def test_a_total_overflow_reads_as_a_partial_reading(users: tuple[int, int], world: Path) -> None:
    """When the owners' shares do not fit in the total cap (here root's own files), the reader
    says the reading is partial (the daemon reports the collector down) and whose files were
    not all read."""
    ranks = world / "ranks"
    _junk(None, ranks, MAX_FILES + 1)
    user_writes(U2, ranks / "u2.json", _doc("u2", 4_100_000))
    reader = RankFileReader(str(ranks))
    _entries, bad = reader.scan()
    assert reader.incomplete and reader.unread_owners == {0, users[1]}  # root's come first
    assert any("uid 0 has 4097 rank files; only 4096 are read" in b.reason for b in bad)


@pytest.fixture
def fixture(tmp_path: Path) -> Path:
    """The H200 recording with one compute process (PID 447, 1.6 GiB) on GPU 0."""
    doc = json.loads(H200.read_text())
    for cyc in doc["cycles"]:
        dev = cyc["devices"][0]
        dev["compute"] = [{"pid": HOLDER, "usedGpuMemory": 1717986918}]
        dev["process_utilization"] = []
        cyc["nvidia_smi_compute_apps"] = []
        cyc["proc"] = {}
    path = tmp_path / "nvml.json"
    path.write_text(json.dumps(doc))
    return path


def _check(world: Path, fixture: Path, holder: int, **kw: Any) -> tuple[int, str]:
    cfg_path = world / "check.yaml"
    cfg_path.write_text(f"rank_dir: {world / 'ranks'}\nnvml:\n  fixture: {fixture}\n")
    inputs = check.default_inputs(load_config(str(cfg_path)), None, 5.0)
    source = NvmlSource(pynvml=RecordedNvml(json.loads(fixture.read_text()), pid_map={HOLDER: holder}, loop=True))
    inputs.read_nvml = lambda: check.read_with_timeout(source, 5.0)
    out = io.StringIO()
    rc = check.run_check(inputs, ["0"], out=out, **kw)
    return rc, out.getvalue()


def _alive(p: subprocess.Popen[Any]) -> bool:
    stat = Path(f"/proc/{p.pid}/stat")
    with contextlib.suppress(OSError):
        return stat.read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    return False


def test_check_kill_never_kills_a_rank_crowded_out(
    users: tuple[int, int], world: Path, fixture: Path, procs: list[subprocess.Popen[Any]]
) -> None:
    ranks = world / "ranks"
    u2_rank = _popen_as(U2, procs)
    user_writes(U2, ranks / "u2.json", _doc("u2job", u2_rank.pid))
    assert _check(world, fixture, u2_rank.pid)[0] == check.EXIT_CLEAN
    # U1's junk: U2's file is still read (U1 gets at most its own share)
    _junk(U1, ranks, MAX_FILES + 1)
    rc, text = _check(world, fixture, u2_rank.pid, kill=True, grace=1, verify_seconds=1)
    assert (rc, text.split(":")[0]) == (check.EXIT_CLEAN, "clean"), text
    assert _alive(u2_rank)
    # Root's files overflow the total cap: nobody's files are all read, so nothing is killed,
    # and the answer is not "clean".
    _junk(None, ranks, MAX_FILES + 1)
    rc, text = _check(world, fixture, u2_rank.pid, kill=True, grace=1, verify_seconds=1)
    time.sleep(0.2)
    assert rc == check.EXIT_OFFENDERS and "refused: the rank files of its user were not all read" in text, text
    assert _alive(u2_rank), text


def test_check_applies_the_trust_rules(
    users: tuple[int, int], world: Path, fixture: Path, procs: list[subprocess.Popen[Any]]
) -> None:
    """N5: U1's file claiming U2's unregistered GPU holder does not make it registered."""
    ranks = world / "ranks"
    holder = _popen_as(U2, procs)
    assert _check(world, fixture, holder.pid)[0] == check.EXIT_OFFENDERS
    user_writes(U1, ranks / "claim.json", _doc("u1job", holder.pid))
    rc, text = _check(world, fixture, holder.pid)
    assert rc == check.EXIT_OFFENDERS and str(holder.pid) in text, text
    # the holder's own user may register it, and root may
    user_writes(U2, ranks / "own.json", _doc("u2job", holder.pid))
    assert _check(world, fixture, holder.pid)[0] == check.EXIT_CLEAN


def test_the_node_cap_is_shared_fairly(users: tuple[int, int], world: Path, procs: list[subprocess.Popen[Any]]) -> None:
    """N11: at most MAX_RANKS_PER_NODE ranks are watched (the memory budget: 4096 did not fit
    the unit's MemoryMax, bench/rank_caps_rss.py), and one owner's many ranks (root's 2000
    here) never crowd out another's few: U1's 10 and U2's 1 are all watched."""
    ranks = world / "ranks"
    job = f"node{os.getpid()}"
    root_rank = subprocess.Popen(SLEEP)
    procs.append(root_rank)
    u1_rank, u2_rank = _popen_as(U1, procs), _popen_as(U2, procs)
    for f in range(8):
        (ranks / f"root{f}.json").write_text(
            json.dumps(
                {
                    "version": 1,
                    "job_id": f"{job}-r{f}",
                    "ranks": [{"rank": r, "pid": root_rank.pid} for r in range(250)],
                }
            )
        )
    user_writes(
        U1,
        ranks / "u1.json",
        json.dumps(
            {"version": 1, "job_id": f"{job}-u1", "ranks": [{"rank": r, "pid": u1_rank.pid} for r in range(10)]}
        ),
    )
    user_writes(U2, ranks / "u2.json", _doc(f"{job}-u2", u2_rank.pid))
    path, cfg = write_config(world, rank_dir=str(ranks))
    d = DaemonProc(path, cfg)
    try:

        def up() -> dict[str, int]:
            n: dict[str, int] = {}
            for (name, labels), v in d.samples().items():
                job_id = dict(labels).get("job_id", "")
                if name == "gpuwatch_rank_up" and v == 1.0 and job_id.startswith(job):
                    n[job_id.split("-")[1][:2]] = n.get(job_id.split("-")[1][:2], 0) + 1
            return n

        d.wait_for(lambda: up().get("u2") == 1, what="U2's rank up")
        counts = up()
        assert sum(counts.values()) == MAX_RANKS_PER_NODE, counts
        assert counts["u1"] == 10 and counts["u2"] == 1, counts
        state = json.loads((world / "state" / "state.json").read_text())
        assert any(
            "uid 0 claims 2000 ranks; only 1013 are watched" in f["explanation"]
            for f in state["findings"]
            if f["kind"] == "bad_rank_file"
        )
    finally:
        d.stop()

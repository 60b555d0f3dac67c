"""Issue 23 N2: a user's own stalled rank answers the flight-recorder request with a hostile
document; it is refused for that rank with a reason, and nothing else changes: every /metrics
scrape (text and OpenMetrics) is answered, the flight_recorder subsystem stays up and root's
stalled job keeps its collective series. Real second user (setpriv), real rank processes that
answer the daemon's real requests, the real daemon.

On 63318c5: ``"pg_id": "\\ud800"`` became a label and every scrape closed with no answer (the
final encode raised); ``1e400`` in ``pg_status`` raised OverflowError every cycle (the subsystem
down for every job); 100,000 nested ``[`` raised RecursionError; a 400-digit
``collective_seq_id`` dropped the family.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

from daemonutil import DaemonProc, write_config
from userutil import rank_world_fixture, user_writes, users_fixture

USER = "gw-n2-fr"
FIXTURES = Path(__file__).parent / "fixtures"
ANSWERER = FIXTURES / "trust" / "fr_answerer.py"
HOSTILE = {  # rank -> (the trace's raw JSON text, what the refusal says)
    0: ('{"entries": [{"collective_seq_id": 3, "pg_id": "\\ud800", "state": "completed"}]}', "pg_id"),
    1: ('{"entries": [], "pg_status": {"0": {"last_started_collective": 1e400}}}', "out of range"),
    2: ("[" * 100_000 + "]" * 100_000, "nested deeper"),
    3: ('{"entries": [{"collective_seq_id": ' + "9" * 400 + ', "pg_id": "0"}]}', "a number of 400"),
}


user = users_fixture(USER)


world = rank_world_fixture("gw-n2-")


def _scrape(url: str, openmetrics: bool) -> str:
    req = urllib.request.Request(
        url, headers={"Accept": "application/openmetrics-text; version=1.0.0"} if openmetrics else {}
    )
    with urllib.request.urlopen(req, timeout=5) as r:
        return str(r.read().decode("utf-8"))


def _stall_findings(world: Path) -> dict[str, str]:
    path = world / "state" / "state.json"
    if not path.exists():
        return {}
    return {
        f"{f['job_id']}/{f['rank']}": f["explanation"]
        for f in json.loads(path.read_text())["findings"]
        if f["kind"] == "rank_stalled"
    }


def test_hostile_answers_are_refused_per_rank(user: int, world: Path, procs: list[subprocess.Popen[Any]]) -> None:
    ranks = world / "ranks"
    answerer = world / "answerer.py"
    shutil.copy(ANSWERER, answerer)
    answerer.chmod(0o644)
    bad_job, good_job = f"frbad{os.getpid()}", f"frgood{os.getpid()}"
    old = time.time() - 600
    bad_ranks = []
    for rank, (payload, _) in HOSTILE.items():
        (world / f"payload{rank}").write_text(payload)
        (world / f"payload{rank}").chmod(0o644)
        p = subprocess.Popen(
            [
                "setpriv",
                f"--reuid={USER}",
                f"--regid={USER}",
                "--clear-groups",
                "/usr/bin/python3",
                str(answerer),
                str(ranks),
                bad_job,
                str(rank),
                str(world / f"payload{rank}"),
            ],
            env={"PATH": "/usr/bin:/bin"},
        )
        procs.append(p)
        hb = ranks / f"{bad_job}.{rank}.hb"
        user_writes(USER, hb, "")
        os.utime(hb, (old, old))
        bad_ranks.append({"rank": rank, "pid": p.pid, "heartbeat": str(hb)})
    user_writes(
        USER, ranks / "bad.json", json.dumps({"version": 1, "job_id": bad_job, "world_size": 4, "ranks": bad_ranks})
    )
    good_trace = json.dumps(json.loads((FIXTURES / "hang" / "fr_gloo_rank0.json").read_text())["trace"])
    (world / "payload-good").write_text(good_trace)
    good = subprocess.Popen(["/usr/bin/python3", str(answerer), str(ranks), good_job, "0", str(world / "payload-good")])
    procs.append(good)
    hb = ranks / f"{good_job}.0.hb"
    hb.write_text("")
    os.utime(hb, (old, old))
    (ranks / "good.json").write_text(
        json.dumps({"version": 1, "job_id": good_job, "ranks": [{"rank": 0, "pid": good.pid, "heartbeat": str(hb)}]})
    )

    path, cfg = write_config(
        world, rank_dir=str(ranks), stall={"after_seconds": 1.5, "flight_recorder_interval_seconds": 1}
    )
    d = DaemonProc(path, cfg)
    try:

        def all_refused() -> bool:
            found = _stall_findings(world)
            return all(
                "unavailable: refused: " in found.get(f"{bad_job}/{r}", "") and why in found[f"{bad_job}/{r}"]
                for r, (_, why) in HOSTILE.items()
            )

        d.wait_for(
            lambda: (
                d.value("gpuwatch_rank_collective_last_started_seq", job_id=good_job, rank="0") == 5.0 and all_refused()
            ),
            timeout=30,
            what="root's collectives and every hostile answer refused",
        )
        end = time.monotonic() + 4.0
        while time.monotonic() < end:  # cycles with every hostile answer present
            for om in (False, True):
                text = _scrape(d.url, om)
                assert f'job_id="{good_job}",rank="0"' in text
                assert bad_job + '",pg="' not in text  # no collective series of a refused answer
            assert d.value("gpuwatch_collector_success", collector="flight_recorder") != 0.0
            time.sleep(0.3)
        assert "Traceback" not in d.log()
    finally:
        d.stop()


def test_the_exposition_survives_a_label_it_cannot_encode() -> None:
    """Defence in depth: even a label value that is not valid UTF-8 text renders (as "?")."""
    from gpuwatchd.exporter.families import Metric
    from gpuwatchd.exporter.render import render_openmetrics, render_text

    fam = Metric("gpuwatch_x", "x", "gauge")
    fam.add_sample("gpuwatch_x", {"pg": "\ud800"}, 1.0)
    assert b'pg="?"' in render_text([fam]) and b'pg="?"' in render_openmetrics([fam])

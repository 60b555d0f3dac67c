"""Issue 23 N9: a hostile rank (500 threads, 600 Python frames each, a real Python process) makes
py-spy's ``dump`` grow past 100 MB RSS and write tens of MB of JSON; the run is killed as soon as
its RSS passes ``MAX_RSS_BYTES`` (or its output the cap), so it never nears the unit's MemoryMax.
On 63318c5 the 4 MiB output cap applied only after py-spy exited: its RSS peaked above 100 MB
here (265 MB with 125 MB of JSON in the attacker's run), and in a 256 MiB cgroup the kernel
OOM-killed it 13 times in 105 s."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from gpuwatchd.sources import pyspy
from gpuwatchd.sources.pyspy import PySpy
from gpuwatchd.sources.pyspy_output import OUTPUT_TOO_LARGE, PySpyError
from gpuwatchd.sources.pyspy_spawn import MAX_RSS_BYTES

HOSTILE = Path(__file__).parent / "fixtures" / "trust" / "deep_threads.py"


def _children_peak(stop: threading.Event, peak: list[int]) -> None:
    """The highest VmHWM of any py-spy child of this process, sampled every 10 ms."""
    me = Path("/proc/self/task")
    while not stop.is_set():
        for task in me.iterdir():
            try:
                kids = (task / "children").read_text().split()
            except OSError:
                continue
            for kid in kids:
                try:
                    status = Path(f"/proc/{kid}/status").read_text()
                except OSError:
                    continue
                if "py-spy" in status.split("\n", 1)[0]:
                    hwm = next((int(ln.split()[1]) << 10 for ln in status.splitlines() if ln.startswith("VmHWM:")), 0)
                    peak[0] = max(peak[0], hwm)
        time.sleep(0.01)


def test_a_dump_of_a_hostile_rank_is_killed_at_its_memory_cap(procs: list[subprocess.Popen[Any]]) -> None:
    target = subprocess.Popen([sys.executable, str(HOSTILE), "500", "600"], stdout=subprocess.PIPE, text=True)
    procs.append(target)
    assert target.stdout is not None and target.stdout.readline().strip() == "ready"
    peak = [0]
    stop = threading.Event()
    watcher = threading.Thread(target=_children_peak, args=(stop, peak), daemon=True)
    watcher.start()
    spy = PySpy(pyspy.resolve_pyspy(), dump_timeout_seconds=60)
    try:
        with pytest.raises(PySpyError) as e:
            spy.dump(target.pid)
    finally:
        stop.set()
        watcher.join(5)
    print(f"py-spy peak RSS {peak[0] >> 20} MiB: {e.value}")
    assert e.value.reason == OUTPUT_TOO_LARGE, e.value
    # the cap plus what one 50 ms look lets it grow, plus the watcher's own 10 ms
    assert 0 < peak[0] <= MAX_RSS_BYTES + (8 << 20), (peak[0] >> 20, str(e.value))


def test_an_oom_kill_of_the_daemons_own_helper_is_named_and_not_a_node_kill(
    tmp_path: Path, procs: list[subprocess.Popen[Any]]
) -> None:
    """A real kernel OOM kill (memory cgroup) of the daemon's py-spy run (a stand-in at
    ``gil.pyspy_path`` that allocates past its cgroup's limit) is a ``helper_oom_kill`` event
    counted in ``gpuwatch_helper_oom_kills_total{helper="py-spy"}``, never an ``oom_kill`` of the
    node (63318c5: ``gpuwatch_oom_kills_total{comm="py-spy",job_id=""}``, one event each)."""
    import json
    import os

    from daemonutil import DaemonProc, write_config
    from kernel_oom_helpers import MemCgroup

    # 40 MiB: below the daemon's own 64 MiB RSS cap on a py-spy run with the file-backed pages
    # (python's text and libraries, ~10 MiB, counted in VmRSS, not charged to this cgroup): the
    # kernel kills first, never the cap (with the 64 MiB default the cap won a race under load)
    cg = MemCgroup("n9helper", limit_bytes=40 << 20)
    pids = tmp_path / "helper.pids"
    pids.write_text("")
    stand_in = tmp_path / "py-spy"
    stand_in.write_text(
        "#!/bin/sh\n"
        f"[ -s {pids} ] && exit 1\n"  # only the first run allocates: one kill
        f"echo $$ >> {pids}\n"
        f"echo $$ > {cg.path}/cgroup.procs\n"
        "exec /usr/bin/python3 -c \"x = b'x' * (256 << 20)\"\n"
    )
    stand_in.chmod(0o755)
    # about half a core: on CPU, so that the GIL sampler runs py-spy on it (an idle rank is not
    # screened, daemon/gil.py)
    rank = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time\nt0 = time.monotonic()\n"
            "while time.monotonic() - t0 < 120:\n    t = time.monotonic()\n"
            "    while time.monotonic() - t < 0.01:\n        pass\n    time.sleep(0.01)\n",
        ]
    )
    procs.append(rank)
    path, cfg = write_config(
        tmp_path,
        kernel_log="kmsg",
        gil={
            "enabled": True,
            "interval_seconds": 1,
            "duration_seconds": 1,
            "healthy_interval_seconds": 1,
            "pyspy_path": str(stand_in),
        },
    )
    (tmp_path / "ranks" / "job.json").write_text(
        json.dumps({"version": 1, "job_id": f"helperjob{os.getpid()}", "ranks": [{"rank": 0, "pid": rank.pid}]})
    )
    d = DaemonProc(path, cfg)
    try:
        d.wait_for(
            lambda: pids.read_text().strip() != "" and cg.oom_kills() >= 1,
            timeout=30,
            what="the helper OOM-killed in its cgroup",
        )
        helper = int(pids.read_text().split()[0])
        events = Path(cfg["state_dir"]) / "events.jsonl"

        def kinds() -> list[str]:
            lines = events.read_text().splitlines() if events.exists() else []
            return [e["kind"] for e in map(json.loads, lines) if e.get("pid") == helper]

        d.wait_for(lambda: kinds() != [], timeout=20, what="the kill's event")
        assert kinds() == ["helper_oom_kill"], kinds()

        # the event is written during the cycle, the counter served from the state at its end: a
        # scrape in between sees the one without the other (clean clone: None right after the event)
        def counted() -> float | None:
            return d.value("gpuwatch_helper_oom_kills_total", helper="py-spy", killer="kernel")

        d.wait_for(lambda: counted() is not None, timeout=10, what="the kill counted")
        assert counted() == 1.0
        ev = next(e for e in map(json.loads, events.read_text().splitlines()) if e.get("pid") == helper)
        assert "gpuwatchd's own py-spy helper" in ev["summary"], ev
    finally:
        d.stop()
        cg.remove()

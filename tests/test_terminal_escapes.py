"""Issue 23 N10: strings a user's rank controls (a stack frame's file name, its comm) never reach
root's terminal or syslog raw. A real second user's stalled rank runs a script whose file name
holds ESC, BEL, CR and LF (an OSC window-title sequence and a forged line); another of its
processes names itself (comm) with the same. ``gpuwatchd ps``, ``doctor``, ``events`` and
``check`` (whose output the Slurm prolog hands to ``logger``) must show them escaped (``\\x1b``,
as systemctl and ls -b do). On 63318c5 each printed them raw: 4-8 forged lines each, and the
window title set."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from daemonutil import REPO, DaemonProc, write_config
from userutil import rank_world_fixture, user_writes, users_fixture

USER = "gw-n10-esc"
EVIL = "\x1b]0;pwned\x07\r\nFORGED LINE\x1b[2J"
ESCAPED = "\\x1b]0;pwned\\x07\\x0d\\x0aFORGED LINE\\x1b[2J"
RAW = ("\x1b", "\x07", "\r")
H200 = Path(__file__).parent / "fixtures" / "nvml" / "h200_orphan_dataloader.json"
# a rank stuck in a function defined in the evil-named file (its frame is the stall's evidence)
STUCK = "import time\ndef load_batch():\n    time.sleep(1000)\nprint('ready', flush=True)\nload_batch()\n"
# renames itself (comm, what ps/check show) and sleeps
NAMED = (
    "import sys, time\nopen('/proc/self/comm', 'w').write(sys.argv[1])\nprint('ready', flush=True)\ntime.sleep(300)\n"
)


user = users_fixture(USER)


world = rank_world_fixture("gw-n10-")


def _as_user(procs: list[subprocess.Popen[Any]], *argv: str) -> subprocess.Popen[Any]:
    p = subprocess.Popen(
        ["setpriv", f"--reuid={USER}", f"--regid={USER}", "--clear-groups", "/usr/bin/python3", *argv],
        stdout=subprocess.PIPE,
        text=True,
        env={"PATH": "/usr/bin:/bin"},
    )
    procs.append(p)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return p


def _cli(*argv: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "gpuwatchd", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        errors="surrogateescape",
    )
    return out.stdout + out.stderr


def _assert_escaped(what: str, text: str, needle: str = ESCAPED) -> None:
    assert needle in text, f"{what}: the escaped string is missing:\n{text!r}"
    assert not any(c in text for c in RAW), f"{what}: raw control characters:\n{text!r}"
    assert not any(line.startswith("FORGED") for line in text.splitlines()), what


def test_ps_doctor_events_and_check_escape_a_ranks_strings(
    user: int, world: Path, procs: list[subprocess.Popen[Any]]
) -> None:
    ranks = world / "ranks"
    script = world / f"evil{EVIL}.py"
    script.write_text(STUCK)
    script.chmod(0o644)
    rank = _as_user(procs, str(script))
    hb = ranks / "esc.hb"
    user_writes(USER, hb, "")
    old = time.time() - 600
    os.utime(hb, (old, old))
    job = f"esc{os.getpid()}"
    user_writes(
        USER,
        ranks / "esc.json",
        json.dumps({"version": 1, "job_id": job, "ranks": [{"rank": 0, "pid": rank.pid, "heartbeat": str(hb)}]}),
    )
    path, cfg = write_config(world, rank_dir=str(ranks), stall={"after_seconds": 1.5})
    d = DaemonProc(path, cfg)
    try:
        state = Path(cfg["state_dir"]) / "state.json"

        def stalled_with_frame() -> bool:
            if not state.exists():
                return False
            return any(
                f["kind"] == "rank_stalled" and "pwned" in f["explanation"]
                for f in json.loads(state.read_text())["findings"]
            )

        d.wait_for(stalled_with_frame, timeout=30, what="the stall naming the evil frame")
        _assert_escaped("ps", _cli("ps", "--config.file", str(path)))
        _assert_escaped("doctor", _cli("doctor", str(rank.pid), "--config.file", str(path)))
        _assert_escaped("events", _cli("events", "--config.file", str(path), "--since", "1h"))
    finally:
        d.stop()

    # check: a holder of GPU memory that names itself with the same string (comm is 15 bytes)
    holder = _as_user(procs, "-c", NAMED, EVIL)
    doc = json.loads(H200.read_text())
    for cyc in doc["cycles"]:
        cyc["devices"][0]["compute"] = [{"pid": 447, "usedGpuMemory": 1 << 30}]
        cyc["devices"][0]["process_utilization"] = []
        cyc["nvidia_smi_compute_apps"] = []
        cyc["proc"] = {}
    fixture = world / "nvml.json"
    fixture.write_text(json.dumps(doc))
    from gpuwatchd.cli import check
    from gpuwatchd.config.schema import load_config
    from gpuwatchd.sources.nvml import NvmlSource
    from gpuwatchd.sources.nvml_fixture import RecordedNvml

    cfg_path = world / "check.yaml"
    cfg_path.write_text(f"rank_dir: {ranks}\nnvml:\n  fixture: {fixture}\n")
    inputs = check.default_inputs(load_config(str(cfg_path)), None, 5.0)
    source = NvmlSource(pynvml=RecordedNvml(doc, pid_map={447: holder.pid}, loop=True))
    inputs.read_nvml = lambda: check.read_with_timeout(source, 5.0)
    import io

    out = io.StringIO()
    assert check.run_check(inputs, ["0"], out=out) == check.EXIT_OFFENDERS
    _assert_escaped("check", out.getvalue(), "\\x1b]0;pwned\\x07\\x0d\\x0aFOR")

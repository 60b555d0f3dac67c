"""A launcher like torchrun's, for the exit tests: starts WORLD ranks (Python processes with
torchrun's variables: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, TORCHELASTIC_RUN_ID), reaps
each the moment it ends (blocked in waitpid, tighter than torchrun's 0.1 s monitor), and on the
first failure SIGTERMs the others at once and SIGKILLs what is left a second later.

    python exit_launcher.py JOB_ID FAULT GO_FILE [--no-teardown] [--world N] [--restart]

Rank 1 meets FAULT once GO_FILE exists (the test creates it when the daemon watches both ranks);
the other ranks sleep. Faults: exc (an uncaught
exception), exit3, segv (a real SIGSEGV: ctypes reads address 1), abort (os.abort), kill, term,
int (the signal sent to itself), ok (exit 0), zombie_leader (the main thread ends alone and the
process exits with code 3 1.5 s later: /proc shows a zombie for those cycles while the pidfd is
not readable yet, as a CUDA rank whose driver teardown outlives its main thread). Rank 0 of an
``ok`` job ends with exit 0 too.
Prints one JSON line: {"pids": {rank: pid}, "reaped": {rank: [wait status, monotonic time]}}.
``--restart``: then starts the whole world again under the same job id (torchrun --max-restarts),
ranks that only sleep, prints {"restarted": {rank: pid}} and waits for them. ``--restarts N``:
instead, N times, starts the world again with the same fault, met 2 s after the start (a
crash loop); one JSON line per attempt.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

RANK = r"""
import os, signal, sys, time
# a rank started from a background shell inherits SIGINT ignored (bash ignores it for `cmd &`
# without job control): the default, as a rank under torchrun in a terminal or a unit has it
signal.signal(signal.SIGINT, signal.SIG_DFL)
fault, go = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
if fault == "sleep":  # a restarted attempt that trains on
    time.sleep(3600)
if os.environ.get("GW_ATTEMPT", "0") != "0":  # a restart meets its fault 2 s in, once watched
    time.sleep(2.0)
while not os.path.exists(go):
    time.sleep(0.01)
if rank != 1:
    if fault == "ok":
        sys.exit(0)
    time.sleep(3600)
if fault == "exc":
    raise RuntimeError("a bug in the training step")
if fault == "exit3":
    sys.exit(3)
if fault == "segv":
    import ctypes
    ctypes.string_at(1)
if fault == "abort":
    os.abort()
if fault == "zombie_leader":  # the main thread ends first; the process exits 1.5 s later
    import ctypes, platform, threading
    threading.Thread(target=lambda: (time.sleep(1.5), os._exit(3))).start()
    ctypes.CDLL(None).syscall({"x86_64": 60, "aarch64": 93}[platform.machine()], 0)
if fault in ("kill", "term", "int"):
    os.kill(os.getpid(), {"kill": signal.SIGKILL, "term": signal.SIGTERM, "int": signal.SIGINT}[fault])
    time.sleep(10)
sys.exit(0)
"""


def main() -> int:
    job, fault, go = sys.argv[1], sys.argv[2], sys.argv[3]
    teardown = "--no-teardown" not in sys.argv
    world = int(sys.argv[sys.argv.index("--world") + 1]) if "--world" in sys.argv else 2

    def spawn(fault: str, attempt: int = 0) -> dict[int, subprocess.Popen[bytes]]:
        procs = {}
        for rank in range(world):
            env = {
                **os.environ,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(world),
                "LOCAL_WORLD_SIZE": str(world),
                "TORCHELASTIC_RUN_ID": job,
                "GROUP_RANK": "0",
                "GW_ATTEMPT": str(attempt),
            }
            procs[rank] = subprocess.Popen([sys.executable, "-c", RANK, fault, go], env=env)
        return procs

    restarts = int(sys.argv[sys.argv.index("--restarts") + 1]) if "--restarts" in sys.argv else 0
    for attempt in range(restarts + 1):
        if attempt:
            time.sleep(1.5)  # torchrun's monitor and the new rendezvous take a few seconds
        run_attempt(spawn(fault, attempt), world, teardown)
    if "--restart" in sys.argv:
        again = spawn("sleep")
        print(json.dumps({"restarted": {r: p.pid for r, p in again.items()}}), flush=True)
        for p in again.values():
            p.wait()
    return 0


def run_attempt(procs: dict[int, subprocess.Popen[bytes]], world: int, teardown: bool) -> None:
    """Reap each rank the moment it ends; on the first failure end the others (SIGTERM, then
    SIGKILL a second later); print the attempt's JSON line."""
    by_pid = {p.pid: r for r, p in procs.items()}
    reaped: dict[int, list[float]] = {}
    killed_at: float | None = None
    while len(reaped) < world:
        pid, status = os.waitpid(-1, os.WNOHANG if killed_at is not None else 0)
        if pid == 0:  # tearing down: SIGKILL what the SIGTERM left after a second
            if time.monotonic() - killed_at > 1.0:
                for r, p in procs.items():
                    if r not in reaped:
                        p.send_signal(signal.SIGKILL)
            time.sleep(0.01)
            continue
        rank = by_pid[pid]
        reaped[rank] = [status, time.monotonic()]
        procs[rank].returncode = 0  # reaped here: Popen must not wait for it again
        if status != 0 and killed_at is None and teardown:
            killed_at = time.monotonic()
            for r, p in procs.items():
                if r not in reaped:
                    p.send_signal(signal.SIGTERM)
    print(json.dumps({"pids": {r: p.pid for r, p in procs.items()}, "reaped": reaped}), flush=True)


if __name__ == "__main__":
    sys.exit(main())

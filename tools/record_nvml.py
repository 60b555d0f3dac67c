#!/usr/bin/env python3
"""Record raw NVML readings to JSON on a GPU node, for replay by gpuwatchd/sources/nvml_fixture.py.

    python3 tools/record_nvml.py --cycles 3 --interval 1 --out tests/fixtures/nvml/NAME.json \
        [--note "what was running"]

Each cycle stores, per device, what the NVML calls that gpuwatchd makes returned, as NVML gave it
(``usedGpuMemory`` null where nvidia-ml-py reported N/A; an ``{"error": code}`` where a call
failed), plus ``nvidia-smi --query-compute-apps`` output and the /proc identity (comm, ppid, uid)
of each listed PID, so that a test can check the reader against nvidia-smi.
Needs only nvidia-ml-py (no gpuwatchd import), so it runs on any GPU node.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from typing import Any

import pynvml as nv


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _call(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except nv.NVMLError as exc:
        return {"error": int(exc.value)}


def _procs(fn: Any, handle: Any) -> Any:
    got = _call(fn, handle)
    if isinstance(got, dict):
        return got
    return [{"pid": int(p.pid), "usedGpuMemory": p.usedGpuMemory} for p in got]


def _proc_identity(pid: int) -> dict[str, Any]:
    try:
        with open(f"/proc/{pid}/stat") as f:
            raw = f.read()
        comm = raw[raw.find("(") + 1 : raw.rfind(")")]
        ppid = int(raw[raw.rfind(")") + 2 :].split()[1])
        uid = os.stat(f"/proc/{pid}").st_uid
    except (OSError, ValueError, IndexError):
        return {"present": False}
    return {"present": True, "comm": comm, "ppid": ppid, "uid": uid}


def _smi() -> list[dict[str, Any]] | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    rows = []
    for line in out.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3:
            mib = int(parts[2]) if parts[2].isdigit() else None
            rows.append({"pid": int(parts[0]), "gpu_uuid": parts[1], "used_memory_mib": mib})
    return rows


def record_cycle(since: dict[int, int]) -> dict[str, Any]:
    count = nv.nvmlDeviceGetCount()
    devices = []
    pids: set[int] = set()
    for i in range(count):
        h = nv.nvmlDeviceGetHandleByIndex(i)
        pci = nv.nvmlDeviceGetPciInfo(h)
        mem = _call(nv.nvmlDeviceGetMemoryInfo, h)
        util = _call(nv.nvmlDeviceGetUtilizationRates, h)
        samples = _call(nv.nvmlDeviceGetProcessUtilization, h, since.get(i, 0))
        if not isinstance(samples, dict):
            samples = [
                {"pid": int(s.pid), "timeStamp": int(s.timeStamp), "smUtil": int(s.smUtil), "memUtil": int(s.memUtil)}
                for s in samples
            ]
            if samples:
                since[i] = max(s["timeStamp"] for s in samples)
        dev = {
            "index": i,
            "uuid": _text(nv.nvmlDeviceGetUUID(h)),
            "name": _text(nv.nvmlDeviceGetName(h)),
            "busId": _text(pci.busId),
            "memory": mem
            if isinstance(mem, dict)
            else {"total": int(mem.total), "used": int(mem.used), "free": int(mem.free)},
            "utilization": util if isinstance(util, dict) else {"gpu": int(util.gpu), "memory": int(util.memory)},
            "compute": _procs(nv.nvmlDeviceGetComputeRunningProcesses, h),
            "graphics": _procs(nv.nvmlDeviceGetGraphicsRunningProcesses, h),
            "process_utilization": samples,
        }
        for kind in ("compute", "graphics"):
            if isinstance(dev[kind], list):
                pids.update(p["pid"] for p in dev[kind])
        devices.append(dev)
    return {
        "timestamp": time.time(),
        "count": count,
        "devices": devices,
        "nvidia_smi_compute_apps": _smi(),
        "proc": {str(p): _proc_identity(p) for p in sorted(pids)},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cycles", type=int, default=3)
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--note", default="")
    args = ap.parse_args(argv)
    nv.nvmlInit()
    try:
        doc: dict[str, Any] = {
            "format": "gpuwatchd-nvml-recording/1",
            "note": args.note,
            "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "driver_version": _text(nv.nvmlSystemGetDriverVersion()),
            "nvml_version": _text(nv.nvmlSystemGetNVMLVersion()),
            "kernel": platform.release(),
            "cycles": [],
        }
        since: dict[int, int] = {}
        for c in range(args.cycles):
            if c:
                time.sleep(args.interval)
            doc["cycles"].append(record_cycle(since))
    finally:
        nv.nvmlShutdown()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"recorded {len(doc['cycles'])} cycles to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What each kind of request does to the running daemon's memory, side by side for two checkouts
(issue 24: a ``name[]`` request or ``Accept: text/plain;version=1.0.0`` used to load
prometheus_client, and with it ssl, for the life of the process).

For each checkout (a directory holding a ``gpuwatchd`` package; default: this one), starts
``python -m gpuwatchd run`` on the NVML replay with the defaults of tests/daemonutil.py, waits
for two cycles, then sends each request in turn and prints VmRSS and whether OpenSSL is mapped
after it. Loopback only; writes nothing outside a temporary directory.

    python -m bench.rss_requests [OLD_CHECKOUT ...]      # e.g. a `git archive 63318c5` export
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench.benchlib import REPO, free_port, rss_kib

FIXTURE = REPO / "tests/fixtures/nvml/h200_bench_9procs.json"
PROMETHEUS = (
    "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.6,application/"
    "openmetrics-text;version=0.0.1;q=0.5,text/plain;version=1.0.0;escaping=allow-utf-8;"
    "q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.2"
)
REQUESTS = [
    ("Prometheus' default Accept (OpenMetrics 1.0.0)", "", {"Accept": PROMETHEUS}),
    ("no Accept (text 0.0.4)", "", {}),
    ("Accept: text/plain;version=0.0.4", "", {"Accept": "text/plain;version=0.0.4"}),
    ("Accept: application/openmetrics-text", "", {"Accept": "application/openmetrics-text"}),
    (
        "Accept: application/openmetrics-text;version=2.0.0",
        "",
        {"Accept": "application/openmetrics-text;version=2.0.0"},
    ),
    ("Accept: text/plain;version=1.0.0", "", {"Accept": "text/plain;version=1.0.0"}),
    (
        "Accept: text/plain;version=1.0.0;escaping=allow-utf-8",
        "",
        {"Accept": "text/plain;version=1.0.0;escaping=allow-utf-8"},
    ),
    ("?name[]=gpuwatch_gpu_info", "?name[]=gpuwatch_gpu_info", {}),
    ("Accept-Encoding: gzip", "", {"Accept-Encoding": "gzip"}),
]


def _ssl_mapped(pid: int) -> bool:
    return any("libssl" in line or "/_ssl." in line for line in Path(f"/proc/{pid}/maps").read_text().splitlines())


def run(checkout: Path) -> list[tuple[int, bool]]:
    with tempfile.TemporaryDirectory(prefix="rss-requests-") as tmp:
        port = free_port()
        (Path(tmp) / "ranks").mkdir()
        cfg = Path(tmp) / "config.yaml"
        cfg.write_text(
            f"web: {{listen_address: '127.0.0.1:{port}'}}\ninterval_seconds: 0.5\n"
            f"rank_dir: {tmp}/ranks\nstate_dir: {tmp}/state\nkernel_log: 'off'\n"
            f"gil: {{enabled: false}}\ndiscovery: {{enabled: false}}\n"
            f"nvml: {{enabled: true, fixture: {FIXTURE}}}\n"
        )
        env = {**os.environ, "PYTHONPATH": str(checkout)}
        proc = subprocess.Popen(
            [sys.executable, "-m", "gpuwatchd", "run", "--config.file", str(cfg)],
            cwd=checkout,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            url = f"http://127.0.0.1:{port}/metrics"
            deadline = time.monotonic() + 30
            while True:
                try:
                    with urllib.request.urlopen(url, timeout=2) as r:
                        if b"gpuwatch_gpu_info" in r.read():
                            break
                except OSError:
                    pass
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise SystemExit(f"{checkout}: the daemon did not serve")
                time.sleep(0.2)
            time.sleep(1.0)
            out = []
            for _, query, headers in REQUESTS:
                with urllib.request.urlopen(urllib.request.Request(url + query, headers=headers), timeout=10) as r:
                    r.read()
                time.sleep(0.3)
                out.append((rss_kib(proc.pid), _ssl_mapped(proc.pid)))
            return out
        finally:
            proc.terminate()
            proc.wait(15)


def main() -> None:
    checkouts = [Path(p).resolve() for p in sys.argv[1:]] + [REPO]
    results = [run(c) for c in checkouts]
    names = [c.name if c != REPO else "this checkout" for c in checkouts]
    print(f"{'after the request':58s}" + "".join(f"{n[:24]:>26s}" for n in names))
    for i, (label, _, _) in enumerate(REQUESTS):
        cells = "".join(f"{r[i][0] / 1024:11.1f} MiB, ssl {'yes' if r[i][1] else 'no ':3s}" for r in results)
        print(f"{label[:58]:58s}{cells}")


if __name__ == "__main__":
    main()

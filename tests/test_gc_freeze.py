"""The daemon freezes what start-up built (gc.freeze: the cyclic collector's full passes skip it,
and never collect it). So what a reload replaces must be freed by reference counting alone: the
old web server (sockets, threads, config) may hold no reference cycle, or every reload would keep
one more for good."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from daemonutil import free_port, write_config

CHILD = textwrap.dedent(
    """
    import gc, sys, threading, time, weakref, yaml
    from gpuwatchd.config.schema import load_config
    from gpuwatchd.daemon.core import Daemon
    path, ports = sys.argv[1], [int(p) for p in sys.argv[2:]]
    d = Daemon(load_config(path), config_path=path)
    t = threading.Thread(target=d.run, daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while d.state is None or d.web is None:
        assert time.monotonic() < deadline, "no first cycle"
        time.sleep(0.05)
    gone = []
    for n in range(3):
        old = d.web
        ref = weakref.ref(old)
        del old
        cfg = yaml.safe_load(open(path))
        cfg["web"]["listen_address"] = f"127.0.0.1:{ports[n + 1]}"
        open(path, "w").write(yaml.safe_dump(cfg))
        d.reload_requested.set()
        while d.web is None or ref() is d.web or d.web.address[1] != ports[n + 1]:
            assert time.monotonic() < deadline, "no reload"
            time.sleep(0.05)
        before = d.state
        while d.state is before:  # the loop went on past the reload
            assert time.monotonic() < deadline, "no cycle after the reload"
            time.sleep(0.05)
        gone.append(ref() is None)
    d.stop_event.set()
    t.join(10)
    print("gone", gone, "frozen", gc.get_freeze_count() > 0)
    """
)


def test_a_reload_frees_the_replaced_web_server_without_the_cyclic_collector(tmp_path: Path) -> None:
    ports = [free_port() for _ in range(4)]
    path, _ = write_config(tmp_path, web={"listen_address": f"127.0.0.1:{ports[0]}"}, interval_seconds=0.2)
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(path), *map(str, ports)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parent,
    )
    assert out.returncode == 0, out.stderr
    assert "gone [True, True, True] frozen True" in out.stdout, (out.stdout, out.stderr)

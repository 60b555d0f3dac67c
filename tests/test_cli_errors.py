"""A user's mistake gets one line on stderr and the exit code of its kind (docs/cli.md: 2 for
what the user gave), never a traceback, never a silent success: the first mistakes a new user
makes, each run through the real CLI."""

from __future__ import annotations

import datetime as dt
import socket
import subprocess
import sys
from pathlib import Path

from daemonutil import free_port, write_config


def gw(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpuwatchd", *args], capture_output=True, text=True, timeout=60)


def one_line(out: subprocess.CompletedProcess[str], code: int, text: str) -> None:
    assert out.returncode == code, out
    assert "Traceback" not in out.stderr and out.stderr.count("\n") == 1, out.stderr
    assert text in out.stderr, out.stderr


def test_a_port_in_use_names_the_address(tmp_path: Path) -> None:
    path, _ = write_config(tmp_path)
    port = free_port()
    with socket.socket() as held:  # another exporter on the port
        held.bind(("127.0.0.1", port))
        held.listen()
        out = gw("run", "--config.file", str(path), "--web.listen-address", f"127.0.0.1:{port}")
    one_line(out, 2, f"gpuwatchd run: cannot listen on 127.0.0.1:{port}: address already in use")
    assert out.stdout == ""


def test_since_takes_durations_and_times_and_refuses_words(tmp_path: Path) -> None:
    path, cfg = write_config(tmp_path)
    Path(cfg["state_dir"]).mkdir()
    one_line(
        gw("events", "--config.file", str(path), "--since", "yesterday"),
        2,
        "gpuwatchd events: --since: 'yesterday' is not a duration (10m, 2h, 7d)",
    )
    hour_ago = (dt.datetime.now() - dt.timedelta(hours=1)).isoformat(timespec="seconds")
    for since in ("1h", "all", hour_ago, hour_ago + "Z", "1700000000"):
        out = gw("events", "--config.file", str(path), "--since", since)
        assert (out.returncode, out.stdout, out.stderr) == (0, "no events\n", ""), (since, out)


def test_events_refuses_a_state_dir_that_does_not_exist(tmp_path: Path) -> None:
    one_line(gw("events", "--state-dir", str(tmp_path / "nope")), 2, f"no state directory {tmp_path / 'nope'}")


def test_register_refuses_a_missing_rank_dir_and_a_dead_pid(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-dir"
    one_line(
        gw("register", "--job-id", "j", "--rank", "0", "--pid", "1", "--rank-dir", str(missing)),
        2,
        f"gpuwatchd register: rank directory {missing} does not exist",
    )
    assert not missing.exists()  # it was created, and the daemon never read it
    dead = subprocess.Popen(["true"])
    dead.wait()
    ranks = tmp_path / "ranks"
    ranks.mkdir()
    one_line(
        gw("register", "--job-id", "j", "--rank", "0", "--pid", str(dead.pid), "--rank-dir", str(ranks)),
        2,
        f"gpuwatchd register: no process {dead.pid}",
    )
    assert list(ranks.iterdir()) == []


def test_a_bad_file_is_exit_2_for_both_checks(tmp_path: Path) -> None:
    """`config check` and `web-config check` refuse a bad file with the same code (2), on stderr."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("interval_seconds: 5s\n")
    out = gw("config", "check", str(bad))
    assert (out.returncode, out.stdout) == (2, "") and "interval_seconds" in out.stderr
    wc = tmp_path / "web.yml"
    wc.write_text("basic_auth_users:\n  john: plain-text\n")
    out = gw("web-config", "check", str(wc))
    assert (out.returncode, out.stdout) == (2, "") and "not a bcrypt hash" in out.stderr


def test_the_checks_take_the_file_as_run_does(tmp_path: Path) -> None:
    """`config check --config.file F` and `web-config check --web.config.file F`, the flags `run`
    takes (and the unit's ExecStart= shows), check F; before, argparse refused them with the top
    level's usage (`gpuwatchd [-h] [--version] COMMAND ...`), exit 2, naming no file."""
    good, _ = write_config(tmp_path)
    out = gw("config", "check", "--config.file", str(good))
    assert (out.returncode, out.stderr) == (0, ""), out
    assert out.stdout.startswith(f"{good}: OK"), out.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("interval_seconds: 5s\n")
    out = gw("config", "check", "--config.file", str(bad))
    assert (out.returncode, out.stdout) == (2, "") and "interval_seconds" in out.stderr, out
    wc = tmp_path / "web.yml"
    wc.write_text("basic_auth_users:\n  john: plain-text\n")
    out = gw("web-config", "check", "--web.config.file", str(wc))
    assert (out.returncode, out.stdout) == (2, "") and "not a bcrypt hash" in out.stderr, out
    one_line(gw("config", "check", str(good), "--config.file", str(bad)), 2, "gpuwatchd config: two files given")


def test_unregister_refuses_a_missing_rank_dir(tmp_path: Path) -> None:
    """As `register` does: a typo in --rank-dir is not "no rank file", exit 0."""
    missing = tmp_path / "no-such-dir"
    one_line(
        gw("unregister", "--job-id", "j", "--rank", "0", "--rank-dir", str(missing)),
        2,
        f"gpuwatchd unregister: rank directory {missing} does not exist",
    )


def test_job_pointed_at_a_server_that_is_not_prometheus_says_so(tmp_path: Path) -> None:
    """A new user's `--prometheus http://node:9863` (the exporter) or a wrong path: the server
    answers 404 with no Prometheus error body. It said "HTTP 404 for '<query>': " and nothing
    more; now it says the URL is not Prometheus's API and what it expects."""
    import http.server
    import threading

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}"
        out = gw("job", "llm-7", "--prometheus", url)
        one_line(
            out,
            2,
            f"gpuwatchd job: {url}/api/v1/query answered HTTP 404: not Prometheus's "
            "query API (--prometheus takes the Prometheus server's URL, e.g. "
            "http://prometheus:9090)",
        )
    finally:
        srv.shutdown()

"""`gpuwatchd ps` and `gpuwatchd events` as the ML engineer on the node: a real second, non-root
user runs the real CLI against the files of a real daemon whose state_dir is what the packaged
unit makes (StateDirectoryMode=0750, owned by the daemon's user and group, UMask=0077).

A member of the state directory's group (docs/cli.md: ``usermod -aG gpuwatchd alice``) reads the
daemon's state and events; anyone else gets one line on stderr saying what to do, exit 3, never
"daemon not running" while the daemon runs, never a traceback. The daemon runs as root here, so
the directory is setgid to the reader group: the files get that group, as the unit's do (its
daemon runs with group gpuwatchd). The user runs Debian's /usr/bin/python3 on this tree
(the test venv's interpreter lives under /root).
"""

from __future__ import annotations

import contextlib
import grp
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import yaml
from daemonutil import DaemonProc, free_port
from userutil import as_user, system_user

REPO = Path(__file__).resolve().parent.parent
USER = "gwclireader"


def cli_as(user: str, *args: str) -> subprocess.CompletedProcess[str]:
    return as_user(
        user,
        "/usr/bin/env",
        f"PYTHONPATH={REPO}",
        "PYTHONDONTWRITEBYTECODE=1",
        "/usr/bin/python3",
        "-m",
        "gpuwatchd",
        *args,
    )


@contextlib.contextmanager
def world() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="gwcli-", dir="/tmp"))
    d.chmod(0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_reader_group_reads_the_daemon_and_others_get_one_honest_line() -> None:
    with system_user(USER), world() as d:
        gid = pwd.getpwnam(USER).pw_gid
        state = d / "state"
        state.mkdir()
        os.chown(state, 0, gid)
        state.chmod(0o2750)  # the unit's 0750; setgid: the files get the group, as under the unit
        (d / "ranks").mkdir()
        cfg = {
            "web": {"listen_address": f"127.0.0.1:{free_port()}"},
            "interval_seconds": 0.5,
            "rank_dir": str(d / "ranks"),
            "state_dir": str(state),
            "kernel_log": "off",
            "gil": {"enabled": False},
            "nvml": {"enabled": False},
            "discovery": {"enabled": False},
        }
        path = d / "config.yaml"
        path.write_text(yaml.safe_dump(cfg))
        path.chmod(0o644)
        rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        subprocess.run(
            [
                sys.executable,
                "-m",
                "gpuwatchd",
                "register",
                "--config.file",
                str(path),
                "--job-id",
                "nr-job",
                "--rank",
                "0",
                "--pid",
                str(rank.pid),
            ],
            check=True,
            capture_output=True,
        )
        umask = os.umask(0o077)  # the unit's UMask=: the daemon inherits it
        try:
            daemon = DaemonProc(path, cfg, log_path=d / "daemon.log")
        finally:
            os.umask(umask)
        try:
            daemon.wait_for(lambda: daemon.value("gpuwatch_rank_up", job_id="nr-job") == 1, what="rank up")
            rank.kill()
            rank.wait()
            daemon.wait_for(lambda: (state / "events.jsonl").exists(), what="rank_down event")
            daemon.wait_for(lambda: (state / "state.json").exists(), what="state file")

            # A member of the group: the daemon's own view, and its events.
            ps = cli_as(USER, "ps", "--config.file", str(path))
            assert ps.returncode == 0, ps.stderr
            assert ps.stdout.startswith("# daemon state") and "nr-job" in ps.stdout, ps.stdout
            ev = cli_as(USER, "events", "--config.file", str(path), "--since", "1h", "--json")
            assert ev.returncode == 0, ev.stderr
            assert "rank_down" in {e["kind"] for e in json.loads(ev.stdout)}
            assert (state / "state.json").stat().st_mode & 0o777 == 0o640  # whatever the umask

            # Not a member: one line saying what to do, exit 3, the daemon never called stopped.
            os.chown(state, 0, 0)
            for cmd in (["ps"], ["events"], ["doctor", str(os.getpid())]):
                out = cli_as(USER, *cmd, "--config.file", str(path))
                assert out.returncode == 3, (cmd, out)
                assert out.stdout == "" and "Traceback" not in out.stderr, (cmd, out)
                assert out.stderr.count("\n") == 1, (cmd, out.stderr)
                assert f"cannot read {state}/" in out.stderr and "permission denied" in out.stderr
                assert "run as root" in out.stderr
                assert "not running" not in out.stdout + out.stderr
            os.chown(state, 0, gid)
            out = cli_as(USER, "events", "--config.file", str(path))
            assert out.returncode == 0 and "rank_down" in out.stdout, out
        finally:
            rank.kill()
            assert daemon.stop() == 0


def test_the_message_names_the_state_directorys_group() -> None:
    """What to ask for: the group of the state directory (the unit's: gpuwatchd; here Debian's
    ``daemon`` group, which the user is not in)."""
    with system_user(USER), world() as d:
        state = d / "state"
        state.mkdir()
        (state / "state.json").write_text("{}")
        os.chown(state, 0, grp.getgrnam("daemon").gr_gid)
        state.chmod(0o750)
        path = d / "config.yaml"
        path.write_text(yaml.safe_dump({"state_dir": str(state), "rank_dir": str(d)}))
        path.chmod(0o644)
        out = cli_as(USER, "ps", "--config.file", str(path))
        assert (out.returncode, out.stdout) == (3, ""), out
        assert out.stderr == (
            f"gpuwatchd ps: cannot read {state}/state.json: permission denied; run "
            "as root, or ask for group daemon (usermod -aG daemon $USER; "
            "docs/cli.md)\n"
        )


def test_an_event_log_written_0600_before_is_readable_by_the_group_after_the_start(tmp_path: Path) -> None:
    """An upgrade from a daemon that wrote its files 0600 (the unit's UMask=0077): the event log is
    the one file not rewritten every cycle, so the daemon's start fixes its mode."""
    from gpuwatchd.events.log import JsonlSink

    log = tmp_path / "events.jsonl"
    log.write_text("")
    log.chmod(0o600)
    JsonlSink(str(tmp_path))
    assert log.stat().st_mode & 0o777 == 0o640


def test_register_refuses_another_users_process_that_the_daemon_would_refuse() -> None:
    """A user's rank file naming a process of another user is never read (rank_claims rule 1: the
    file's owner must be root or the process's own uid): ``register`` says so, exit 2, and writes
    nothing, instead of printing the file's path and exit 0 while the daemon skips it. Its own
    process is registered; root registers anyone's."""
    with system_user(USER) as uid, world() as d:
        ranks = d / "ranks"
        ranks.mkdir()
        ranks.chmod(0o1777)
        own = subprocess.Popen(
            ["setpriv", f"--reuid={USER}", f"--regid={USER}", "--clear-groups", "/usr/bin/sleep", "60"]
        )
        try:
            out = cli_as(USER, "register", "--job-id", "j", "--rank", "0", "--pid", "1", "--rank-dir", str(ranks))
            assert (out.returncode, out.stdout) == (2, ""), out
            assert "Traceback" not in out.stderr and out.stderr.count("\n") == 1, out.stderr
            assert out.stderr.startswith(f"gpuwatchd register: process 1 is uid 0's, not yours (uid {uid})"), out.stderr
            assert list(ranks.iterdir()) == []
            for _ in range(100):  # setpriv has exec'd sleep: /proc shows the user's uid
                if os.stat(f"/proc/{own.pid}").st_uid == uid:
                    break
                time.sleep(0.05)
            out = cli_as(
                USER, "register", "--job-id", "j", "--rank", "0", "--pid", str(own.pid), "--rank-dir", str(ranks)
            )
            assert (out.returncode, out.stdout) == (0, f"{ranks}/j.0.json\n"), out
            root = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "gpuwatchd",
                    "register",
                    "--job-id",
                    "k",
                    "--rank",
                    "0",
                    "--pid",
                    str(own.pid),
                    "--rank-dir",
                    str(ranks),
                ],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert root.returncode == 0, root
        finally:
            own.kill()
            own.wait()


def test_unregister_says_when_the_rank_file_is_another_users() -> None:
    """In the sticky rank directory only a file's owner (or root) removes it. ``unregister`` of
    another user's rank file said "no rank file for job j rank 0", exit 0, with the file still
    there; now it names the file and its owner, exit 3 (it cannot be removed by this user)."""
    with system_user(USER), world() as d:
        ranks = d / "ranks"
        ranks.mkdir()
        ranks.chmod(0o1777)
        held = subprocess.Popen(["sleep", "60"])
        try:
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "gpuwatchd",
                    "register",
                    "--job-id",
                    "j",
                    "--rank",
                    "0",
                    "--pid",
                    str(held.pid),
                    "--rank-dir",
                    str(ranks),
                ],
                check=True,
                capture_output=True,
                timeout=60,
            )
            out = cli_as(USER, "unregister", "--job-id", "j", "--rank", "0", "--rank-dir", str(ranks))
            assert (out.returncode, out.stdout) == (3, ""), out
            assert out.stderr == (
                f"gpuwatchd unregister: cannot remove {ranks}/j.0.json: it is uid "
                "0's (only its owner or root removes it)\n"
            ), out.stderr
            assert (ranks / "j.0.json").exists()
        finally:
            held.kill()
            held.wait()

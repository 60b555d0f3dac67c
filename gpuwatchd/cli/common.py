"""What every ``gpuwatchd`` command shares: the ``--config.file`` option, the configuration it
resolves to, the daemon's latest state (``state_dir/state.json``, or one local cycle when the
daemon is not running), and the exit codes. A leaf of ``cli/``: the command modules import it,
never ``cli/__init__``.

Exit codes, one meaning each across every subcommand (docs/cli.md):

- 0 ``EXIT_OK``: done; nothing wrong found.
- 1 ``EXIT_FOUND``: the command worked and found a problem (``check``: GPU memory held outside any
  job; ``job``: a rank failed).
- 2 ``EXIT_USAGE``: what the user gave is wrong: arguments, a config or web-config file, a PID,
  job or directory that does not exist, a listen address already in use.
- 3 ``EXIT_UNAVAILABLE``: what the command needs cannot be read or reached: the daemon's files
  (permission denied), Prometheus, the NVIDIA library.
"""

from __future__ import annotations

import argparse
import errno
import grp
import json
import os
import time
from typing import Any

from gpuwatchd.config.schema import Config, load_config, with_overrides

DEFAULT_CONFIG = "/etc/gpuwatchd/config.yaml"
EXIT_OK, EXIT_FOUND, EXIT_USAGE, EXIT_UNAVAILABLE = 0, 1, 2, 3
# What each code means, in every command: `gpuwatchd --help` and the manual page's EXIT STATUS
EXIT_MEANINGS = (
    (EXIT_OK, "done; nothing wrong found"),
    (EXIT_FOUND, "the command worked and found a problem (check, job)"),
    (
        EXIT_USAGE,
        "what you gave is wrong (options, files, a PID or directory that does not exist, "
        "another user's PID to register, a port in use)",
    ),
    (EXIT_UNAVAILABLE, "what the command needs cannot be read or reached (the daemon's files, Prometheus, NVML)"),
)


class CliError(Exception):
    """One line on stderr and an exit code: a user's mistake or an unreadable input is never a
    traceback. ``cli.main`` prints ``gpuwatchd COMMAND: message``."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def unreadable(path: str, e: OSError) -> CliError:
    """The error for a file of the daemon that cannot be read: what to do when it is permissions
    (the packaged unit's state_dir is 0750, its files 0640, owned by the daemon's user and group)."""
    if e.errno in (errno.EACCES, errno.EPERM):
        group = _owner_group(os.path.dirname(path))
        hint = (
            f"run as root, or ask for group {group} (usermod -aG {group} $USER; docs/cli.md)"
            if group
            else "run as root"
        )
        return CliError(f"cannot read {path}: permission denied; {hint}", EXIT_UNAVAILABLE)
    return CliError(f"cannot read {path}: {e.strerror or e}", EXIT_UNAVAILABLE)


def _owner_group(path: str) -> str | None:
    try:
        gid = os.stat(path).st_gid
    except OSError:
        return None
    if gid == 0:
        return None
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def config_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config.file",
        dest="config_file",
        default=None,
        help=f"YAML config (default: {DEFAULT_CONFIG} if it exists, else built-in defaults)",
    )


def checked_file(positional: str | None, flag: str | None, flag_name: str, default: str | None = None) -> str:
    """The file a check command is given as ``FILE`` or as ``run``'s flag (one of them)."""
    if positional and flag and positional != flag:
        raise CliError(f"two files given ({positional} and {flag_name} {flag}): give one", EXIT_USAGE)
    path = positional or flag or default
    if path is None:
        raise CliError(f"no file given: FILE or {flag_name} FILE", EXIT_USAGE)
    return path


def resolve_config(args: argparse.Namespace) -> Config:
    path = getattr(args, "config_file", None)
    if path is None and os.path.exists(DEFAULT_CONFIG):
        path = DEFAULT_CONFIG
    cfg = load_config(path)
    return with_overrides(cfg, getattr(args, "listen_address", None), getattr(args, "web_config_file", None))


def load_state(cfg: Config) -> tuple[dict[str, Any], str]:
    """The daemon's latest state (``state_dir/state.json``) when fresh, else one local cycle."""
    from gpuwatchd.daemon.core import STATE_FILE, Daemon
    from gpuwatchd.daemon.services import Services
    from gpuwatchd.daemon.state_json import state_to_json
    from gpuwatchd.daemon.wiring import no_parts

    path = os.path.join(cfg.state_dir, STATE_FILE)
    why = f"daemon not running (no {path})"
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        # a state file is untrusted input: anything but the daemon's document is not used
        if not isinstance(data, dict):
            raise TypeError("not an object")
        age = time.time() - float(data["timestamp"])
        if age <= 3 * cfg.interval_seconds + 5:
            return data, f"daemon state {age:.0f}s old"
        why = f"daemon not running ({path} is {age:.0f}s old)"
    except FileNotFoundError:
        pass
    except OSError as e:
        # A daemon that runs but whose files this user may not read is not "not running": say
        # so, and what to do, rather than show a view without it.
        raise unreadable(path, e) from None
    except (ValueError, KeyError, TypeError, RecursionError):
        why = f"daemon state unusable ({path} is not the daemon's document)"
    # no part and no event log: this user's one cycle reads rank files and /proc only
    d = Daemon(cfg, parts=no_parts, write_state=False, services=Services.build(cfg, write_state=False, event_log=False))
    return state_to_json(d.cycle()), f"{why}: live /proc view, no GPU/kernel/GIL data"

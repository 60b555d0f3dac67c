"""What every ``gpuwatchd`` command shares: the ``--config.file`` option, the configuration it
resolves to, and the daemon's latest state (``state_dir/state.json``, or one local cycle when the
daemon is not running). A leaf of ``cli/``: the command modules import it, never ``cli/__init__``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

from gpuwatchd.config import Config, load_config, with_overrides

DEFAULT_CONFIG = "/etc/gpuwatchd/config.yaml"


def config_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config.file", dest="config_file", default=None,
                   help=f"YAML config (default: {DEFAULT_CONFIG} if it exists, else built-in defaults)")


def resolve_config(args: argparse.Namespace) -> Config:
    path = getattr(args, "config_file", None)
    if path is None and os.path.exists(DEFAULT_CONFIG):
        path = DEFAULT_CONFIG
    cfg = load_config(path)
    return with_overrides(cfg, getattr(args, "listen_address", None),
                          getattr(args, "web_config_file", None))


def load_state(cfg: Config) -> tuple[dict[str, Any], str]:
    """The daemon's latest state (``state_dir/state.json``) when fresh, else one local cycle."""
    from gpuwatchd.daemon.core import STATE_FILE, Daemon
    from gpuwatchd.daemon.state_json import state_to_json

    path = os.path.join(cfg.state_dir, STATE_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        # a state file is untrusted input: anything but the daemon's document is not used
        age = time.time() - float(data["timestamp"]) if isinstance(data, dict) else float("inf")
        if age <= 3 * cfg.interval_seconds + 5:
            return data, f"daemon state {age:.0f}s old"
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        pass
    d = Daemon(cfg, subsystems=[], write_state=False)
    return state_to_json(d.cycle()), "daemon not running: live /proc view, no GPU/kernel/GIL data"

"""``gpuwatchd web-config check FILE`` and ``gpuwatchd web-config hash``: validate a /metrics
web-config file (web/web_config.py) and load its certificates; print a bcrypt hash for
``basic_auth_users``. Reads the file given (or the password from stdin); writes stdout only.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from gpuwatchd.cli.common import EXIT_USAGE, checked_file
from gpuwatchd.web.web_config import WebConfigError, load_web_config


def register(subparsers: Any) -> None:
    """Add ``gpuwatchd web-config {check,hash}`` to the CLI."""
    p = subparsers.add_parser("web-config", help="check a /metrics web-config file (TLS, auth)")
    sub = p.add_subparsers(dest="web_config_command", required=True)
    c = sub.add_parser("check", help="validate a web-config file and load its certificates")
    c.add_argument("file", nargs="?", help="the web-config file (or --web.config.file)")
    c.add_argument(
        "--web.config.file", dest="web_config_file", default=None, help="the web-config file, as `run` takes it"
    )
    c.set_defaults(func=_cmd_check)
    h = sub.add_parser("hash", help="print a bcrypt hash for basic_auth_users (reads stdin)")
    h.add_argument("--cost", type=int, default=10)
    h.set_defaults(func=_cmd_hash)


def _cmd_check(args: argparse.Namespace) -> int:
    args.file = checked_file(args.file, args.web_config_file, "--web.config.file")
    try:
        cfg = load_web_config(args.file)
    except WebConfigError as e:
        print(f"{e.path}: invalid", file=sys.stderr)
        for problem in e.problems:
            print(f"  {problem}", file=sys.stderr)
        return EXIT_USAGE  # a bad file is a configuration error, as `config check` says it
    parts = []
    if cfg.tls:
        parts.append(f"TLS (min {cfg.tls.min_version}, client certificates: {cfg.tls.client_auth_type})")
    else:
        parts.append("plain HTTP")
    if cfg.basic_auth_users:
        parts.append(f"basic auth for {len(cfg.basic_auth_users)} user(s)")
    if cfg.rate_limit:
        parts.append(f"rate limit {cfg.rate_limit.burst} per {cfg.rate_limit.interval_seconds}s")
    print(f"{args.file}: ok: " + ", ".join(parts))
    return 0


def _read_line() -> str:
    """One line of stdin, decoded strictly as UTF-8 whatever the locale (UnicodeDecodeError)."""
    return sys.stdin.buffer.readline(4096).decode("utf-8")


def _cmd_hash(args: argparse.Namespace, read: Callable[[], str] | None = None) -> int:
    if not 4 <= args.cost <= 31:
        print("--cost must be between 4 and 31", file=sys.stderr)
        return 2
    import getpass

    import bcrypt  # here: `gpuwatchd run` imports this module, and needs bcrypt only for basic auth

    if read is None:
        read = (lambda: getpass.getpass("password: ")) if sys.stdin.isatty() else _read_line
    try:
        password = read().rstrip("\n").encode()
    except UnicodeError:
        # Prometheus's basic_auth password (and a web-config) is YAML, which is UTF-8 text: a
        # password that is not could never be configured in the scraper
        print("password is not UTF-8 text", file=sys.stderr)
        return 2
    if not password:
        print("empty password", file=sys.stderr)
        return 2
    if len(password) > 72:
        # bcrypt reads 72 bytes at most (bcrypt 5 refuses more; older ones ignored the rest, so
        # two passwords that share 72 bytes would both pass).
        print(f"password is {len(password)} bytes; bcrypt uses at most 72: choose a shorter one", file=sys.stderr)
        return 2
    print(bcrypt.hashpw(password, bcrypt.gensalt(args.cost)).decode())
    return 0

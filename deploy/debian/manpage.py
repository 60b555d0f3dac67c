"""Write gpuwatchd(1), the manual page, from the CLI's own argparse parser
(``gpuwatchd.cli.build_parser``): every subcommand at every depth, its help, usage and options,
so the page says what ``gpuwatchd COMMAND --help`` says. Run with gpuwatchd importable:

    PYTHONPATH=STAGE/usr/lib/gpuwatchd/lib/python3.11/site-packages \\
        python3 deploy/debian/manpage.py > gpuwatchd.1

The date is SOURCE_DATE_EPOCH's (reproducible builds), else today's. Standard library only,
besides gpuwatchd.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from gpuwatchd import __version__
from gpuwatchd.cli import build_parser
from gpuwatchd.cli.common import EXIT_MEANINGS

FILES = (
    ("/etc/gpuwatchd/config.yaml", "the configuration (gpuwatchd config check FILE validates one)"),
    ("/run/gpuwatch/ranks", "the rank directory: one JSON file per rank or job, written by launchers"),
    ("/var/lib/gpuwatchd", "the daemon's state: the kernel-log cursor, counters and recent events"),
    ("/lib/systemd/system/gpuwatchd.service", "the hardened unit the package enables"),
)


def _roff(text: str) -> str:
    """Text safe in a roff line: backslashes and hyphens escaped, no leading control character."""
    text = text.replace("\\", "\\e").replace("-", "\\-")
    return "\\&" + text if text.startswith((".", "'")) else text


def _subparsers(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """(name, help, parser) of each subcommand of ``parser``, in the order they were added."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for name, sub in action.choices.items():
                out.append((name, helps.get(name, ""), sub))
    return out


def _options(parser: argparse.ArgumentParser) -> list[str]:
    lines = []
    formatter = parser._get_formatter()
    for action in parser._actions:
        if isinstance(action, (argparse._SubParsersAction, argparse._HelpAction)):
            continue
        # argparse's own "--opt METAVAR, -o METAVAR" (choices as {a,b}), as --help prints it
        invocation = formatter._format_action_invocation(action)
        names = f"\\fB{_roff(invocation)}\\fR" if action.option_strings else f"\\fI{_roff(invocation)}\\fR"
        help_text = action.help if action.help and action.help != argparse.SUPPRESS else ""
        if action.required and action.option_strings:
            help_text = (help_text + " " if help_text else "") + "(required)"
        lines += [".TP", names, _roff(help_text % {"default": action.default} if "%(" in help_text
                                     else help_text) or "\\&"]
    return lines


def _commands(parser: argparse.ArgumentParser, path: str) -> list[str]:
    lines = []
    for name, help_text, sub in _subparsers(parser):
        full = f"{path} {name}"
        usage = " ".join(sub.format_usage().split()[1:])  # "usage: gpuwatchd run [-h] ..."
        lines += [f'.SS "{_roff(full)}"', _roff(help_text or sub.description or ""), ".PP",
                  f"\\fB{_roff(usage)}\\fR"]
        if sub.description and sub.description != help_text:
            lines += [".PP", _roff(" ".join(sub.description.split()))]
        lines += _options(sub)
        lines += _commands(sub, full)
    return lines


def main() -> None:
    parser = build_parser()
    description = (parser.description or "").rstrip(".")
    when = time.gmtime(int(os.environ.get("SOURCE_DATE_EPOCH", time.time())))
    lines = [
        f'.TH GPUWATCHD 1 "{time.strftime("%Y-%m-%d", when)}" "gpuwatchd {__version__}" "User Commands"',
        ".SH NAME",
        f"gpuwatchd \\- {_roff(description[:1].lower() + description[1:])}",
        ".SH SYNOPSIS",
        f"\\fB{_roff(' '.join(parser.format_usage().split()[1:]))}\\fR",
        ".SH DESCRIPTION",
        "gpuwatchd joins NVML, /proc, the kernel log and py\\-spy evidence by (job, rank) and serves",
        "them to Prometheus on port 9863; the package runs it as the systemd unit",
        "gpuwatchd.service. The subcommands below are its daemon, its checks and its views of one",
        "node; each takes \\fB\\-h\\fR for the same text.",
        ".SH OPTIONS",
        *_options(parser),
        ".SH COMMANDS",
        *_commands(parser, parser.prog),
        '.SH "EXIT STATUS"',
        "One meaning per code, in every command; errors are one line on standard error.",
    ]
    for code, meaning in EXIT_MEANINGS:
        lines += [".TP", f"\\fB{code}\\fR", _roff(meaning[:1].upper() + meaning[1:] + ".")]
    lines += [
        ".PP",
        "\\fBrun\\fR also exits 75 once per boot when the device cgroup denies /dev/nvidia*, so that"
        " systemd's Restart= brings it back with the devices.",
        ".SH FILES",
    ]
    for path, what in FILES:
        lines += [".TP", f"\\fI{_roff(path)}\\fR", _roff(what)]
    lines += [".SH SEE ALSO", "\\fBsystemctl\\fR(1), \\fBjournalctl\\fR(1), /usr/share/doc/gpuwatchd/"]
    sys.stdout.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

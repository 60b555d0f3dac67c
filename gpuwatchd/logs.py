"""The daemon's log: ``--log.level`` and ``--log.format`` (the flags and values of Prometheus'
exporters, promslog).

``text`` (the default) is ``TIME LEVEL LOGGER: message`` (without the time under journald, which
stamps each line itself); ``logfmt`` is ``ts=... level=info logger=... msg="..."``; ``json`` one
object per line with the same keys. A message with line breaks (a refused reload lists every
problem) stays one line in logfmt and JSON, which escape the breaks, so Loki or Elasticsearch never
split it.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os

FORMATS = ("text", "logfmt", "json")
LEVELS = ("debug", "info", "warning", "error")


def _fields(record: logging.LogRecord, formatter: logging.Formatter) -> list[tuple[str, str]]:
    ts = dt.datetime.fromtimestamp(record.created, dt.timezone.utc).isoformat(timespec="milliseconds")
    fields = [
        ("ts", ts.replace("+00:00", "Z")),
        ("level", record.levelname.lower()),
        ("logger", record.name),
        ("msg", record.getMessage()),
    ]
    if record.exc_info:
        fields.append(("exc", formatter.formatException(record.exc_info)))
    return fields


class LogfmtFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return " ".join(f"{k}={_logfmt_value(v)}" for k, v in _fields(record, self))


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(dict(_fields(record, self)), ensure_ascii=False)


def _logfmt_value(v: str) -> str:
    if v and not any(c in v for c in ' ="\\') and v.isprintable():
        return v
    return json.dumps(v, ensure_ascii=False)  # quoted, with \n, \" and \\ escaped, as go-logfmt does


def configure(level: str, fmt: str) -> None:
    """Route the root logger to stderr at ``level`` in ``fmt`` (one of ``FORMATS``)."""
    handler = logging.StreamHandler()
    if fmt == "logfmt":
        handler.setFormatter(LogfmtFormatter())
    elif fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(
            logging.Formatter(
                "%(levelname)s %(name)s: %(message)s"
                if os.environ.get("JOURNAL_STREAM")
                else "%(asctime)s %(levelname)s %(name)s: %(message)s"
            )
        )
    logging.basicConfig(level=getattr(logging, level.upper()), handlers=[handler], force=True)

"""The daemon's log output: plain text lines, or one JSON object per line.

A JSON line always has ``ts`` (UTC, ISO 8601 with milliseconds), ``level``, ``logger`` and
``msg``, then the record's own fields (what the call passed in ``extra=``, e.g. the RPC
line's ``peer``, ``method``, ``batch``, ``bytes_sent``, ``duration_ms`` and ``code``), and
``exc`` with the traceback when there is one.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any, TextIO

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
#: What every LogRecord carries; anything else on a record is one of its fields.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message", "asctime", "taskName"}
_BASE = ("ts", "level", "logger", "msg")


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (newlines in values are escaped)."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": _iso(record.created), "level": record.levelname, "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update({name: value for name, value in record.__dict__.items()
                    if name not in _STANDARD and name not in _BASE})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exc"] = record.exc_text
        return json.dumps(out, default=str, ensure_ascii=False)


def _iso(created: float) -> str:
    ms = int(created * 1000) % 1000
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created)) + f".{ms:03d}Z"


def configure(level: str, fmt: str = "text", stream: TextIO | None = None) -> None:
    """Send every log record to ``stream`` (stderr) as ``fmt`` ("text" or "json")."""
    handler = logging.StreamHandler(stream or sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())

"""Logging for the daemon: plain text or one JSON object a line (``log_format``), on stderr
so journald and kubectl logs take it as it is. Re-applied on SIGHUP."""

from __future__ import annotations

import json
import logging
import sys

from agent.settings import Settings


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return json.dumps({"time": self.formatTime(record), "level": record.levelname.lower(), "logger": record.name, "msg": record.getMessage()})


def setup_logging(settings: Settings) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if settings.log_format == "json":
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(settings.log_level.upper())

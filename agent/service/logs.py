"""Logging for the daemon: plain text or one JSON object a line (``log_format``), on stderr
so journald and kubectl logs take it as it is. Re-applied on SIGHUP."""

from __future__ import annotations

import json
import logging
import sys

from agent.settings import Settings


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"time": self.formatTime(record), "level": record.levelname.lower(), "logger": record.name, "msg": record.getMessage()}
        if record.exc_info:  # log.exception's traceback: what a log shipper's reader needs most
            out["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out)


class _RequestsAtDebug(logging.Filter):
    """httpx2 logs every HTTP request at INFO; to an operator they are debug detail (the
    prepare and publish lines say what happened), so they are shown at debug level only."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.INFO:
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return logging.getLogger().isEnabledFor(logging.DEBUG)
        return True


def setup_logging(settings: Settings) -> None:
    # The formats name no caller, thread or process: not looking them up for every record is
    # the Logging HOWTO's own advice ("Optimization").
    logging._srcfile = None
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    handler = logging.StreamHandler(sys.stderr)
    if settings.log_format == "json":
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(settings.log_level.upper())
    http = logging.getLogger("httpx2")  # lightkube's HTTP client
    if not any(isinstance(f, _RequestsAtDebug) for f in http.filters):
        http.addFilter(_RequestsAtDebug())

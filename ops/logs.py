"""Structured logs: one JSON object per line on stderr (or plain text for a terminal)."""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import time
from collections.abc import Iterator


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info and record.exc_info[0] is not None:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(level: str = "INFO", *, json_lines: bool | None = None) -> None:
    """JSON lines unless stderr is a terminal (override with ``json_lines``)."""
    if json_lines is None:
        json_lines = not sys.stderr.isatty()
    handler = logging.StreamHandler(sys.stderr)
    if json_lines:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
        logging.Formatter.converter = time.localtime
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("kafka", "aiohttp.access", "nats"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))


@contextlib.contextmanager
def quiet(*names: str) -> Iterator[None]:
    """Silence the named loggers for the block (a client library's retry chatter while the daemon starts:
    a start-up that fails says why in one line of its own)."""
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)

"""Structured logs: one JSON object per line on stderr (or plain text for a terminal).

With JSON lines every line a daemon writes on stderr parses, so nothing else may write there: Python
warnings are logged, and :func:`route_model_library_output` turns off the model libraries' progress bars
and hands their log records to the root handler.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
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
    if json_lines:
        # huggingface_hub (and transformers, which follows it) reads this when imported, child processes too
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
        logging.captureWarnings(True)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("kafka", "aiohttp.access", "nats"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))


def route_model_library_output() -> None:
    """No progress bars from transformers ("Loading weights" on every load, "Writing model shards" on every
    weight publish) or huggingface_hub, and transformers' log records through the root handler instead of
    its own plain-text one. Imports transformers: call it in processes that load a model anyway."""
    from huggingface_hub.utils import disable_progress_bars
    from transformers.utils import logging as hf_logging

    disable_progress_bars()
    hf_logging.disable_progress_bar()
    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()


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

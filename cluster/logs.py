"""Structured, quiet-by-default logging: ``time level logger message key=value ...``."""

from __future__ import annotations

import logging
import sys

_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class KeyValueFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        extras = " ".join(f"{k}={v}" for k, v in vars(record).items() if k not in _STANDARD)
        line = f"{self.formatTime(record, '%H:%M:%S')} {record.levelname.lower():<7} {record.name} {record.getMessage()}"
        if extras:
            line += " " + extras
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def setup_logging(verbose: bool = False) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(KeyValueFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO if verbose else logging.WARNING)
    for noisy in ("httpx", "uvicorn.access", "filelock", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)

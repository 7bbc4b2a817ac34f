"""Structured, quiet-by-default logging: ``time level logger message key=value ...``."""

from __future__ import annotations

import json
import logging
import sys

_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


def _value(value: object) -> str:
    """A field's value as one token: quoted (JSON) when it has spaces, quotes or control
    characters, so no value (a client's id, an error's text) can end the line or forge a field."""
    text = str(value)
    if text and text.isprintable() and not any(c in text for c in ' "='):
        return text
    return json.dumps(text)


class KeyValueFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        extras = " ".join(f"{k}={_value(v)}" for k, v in vars(record).items() if k not in _STANDARD)
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

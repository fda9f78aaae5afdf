"""Logging for every command: one line a record, as text or as one JSON object (``log_format``)."""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime

from app.redaction import redact

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# What every LogRecord carries; anything else on a record came from ``extra=`` (a request's fields).
_STANDARD = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """``{"time", "level", "logger", "message"}``, the fields given as ``extra=``, and the
    traceback as ``exception`` when there is one; the passwords of URLs masked."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
                 "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        entry.update({k: v for k, v in vars(record).items() if k not in _STANDARD})
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return redact(json.dumps(entry, ensure_ascii=False, default=str))


class TextFormatter(logging.Formatter):
    """``TEXT_FORMAT``, with the passwords of URLs masked (``app/redaction.py``)."""

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


def configure_logging(level: str, log_format: str) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter(TEXT_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler])
    # Alembic logs its plug-ins and every migration step at INFO, huggingface_hub's HTTP client
    # every request of a download: noise in a server's log and over a progress bar.
    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
        for name in ("alembic", "httpx2"):
            logging.getLogger(name).setLevel(logging.WARNING)

"""How every Pagoda process formats its log records: plain text, or one JSON object per line
(`--log-format json`) for log shippers. Structured fields passed as `extra={"fields": {...}}` appear
as `key=value` pairs in text and as top-level keys in JSON."""

from __future__ import annotations

import json
import logging
import time

TEXT_FORMAT = "%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s"


class TextFormatter(logging.Formatter):
    def __init__(self):
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        fields = getattr(record, "fields", None)
        if fields:
            text += " " + " ".join(f"{key}={_text(value)}" for key, value in fields.items())
        return text


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "process": record.processName,
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update(getattr(record, "fields", None) or {})
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


def _text(value) -> str:
    if isinstance(value, str) and (not value or any(c.isspace() or c in '"=' for c in value)):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, float):
        return f"{value:.4g}"
    return json.dumps(value, ensure_ascii=False) if isinstance(value, (list, dict)) else str(value)


def formatter(kind: str) -> logging.Formatter:
    if kind == "json":
        return JsonFormatter()
    if kind == "text":
        return TextFormatter()
    raise ValueError(f"unknown log format {kind!r}; choose text or json")

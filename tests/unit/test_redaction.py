"""Secrets kept out of printed and logged text (app/redaction.py), with plain strings."""

from __future__ import annotations

import json
import logging

import pytest

from app.logs import TEXT_FORMAT, JsonFormatter, TextFormatter
from app.redaction import redact, shown_setting


@pytest.mark.parametrize("text,shown", [
    ("postgresql://sem:pw@db:5432/semantic", "postgresql://sem:***@db:5432/semantic"),
    ("postgres://u:p@ss/w@host/db", "postgres://u:***@host/db"),  # unencoded "@" and "/" in the password
    ("postgres:u:pw@host/db", "postgres:u:***@host/db"),  # malformed: no "//"
    ("postgresql://h/db?user=u&password=pw&sslmode=require", "postgresql://h/db?user=u&password=***&sslmode=require"),
    ("s3://b/p?endpoint=http://AKIA:pw@minio:9000", "s3://b/p?endpoint=http://AKIA:***@minio:9000"),
    ("sqlite:////home/u/.semantic/semantic.db", "sqlite:////home/u/.semantic/semantic.db"),
    ("http://127.0.0.1:8000/v1/agents/a 200", "http://127.0.0.1:8000/v1/agents/a 200"),
    ("GET /v1/agents/x 404 request r agent x", "GET /v1/agents/x 404 request r agent x"),
])
def test_a_urls_password_is_masked_and_nothing_else_changes(text: str, shown: str) -> None:
    assert redact(text) == shown


def test_secret_named_settings_are_not_shown_and_urls_are_masked() -> None:
    assert shown_setting("api_key", "sk-1") == "(set, not shown)"
    assert shown_setting("api_key", "") == ""
    assert shown_setting("database_url", "postgresql://u:pw@h/d") == "postgresql://u:***@h/d"
    assert shown_setting("max_output_tokens", 4096) == 4096 and shown_setting("model", "smollm2") == "smollm2"


@pytest.mark.parametrize("formatter", [TextFormatter(TEXT_FORMAT), JsonFormatter()], ids=["text", "json"])
def test_log_lines_mask_passwords(formatter: logging.Formatter) -> None:
    record = logging.makeLogRecord({"name": "app.store.db", "levelname": "ERROR", "msg": "cannot connect to %s",
                                    "args": ("postgresql://sem:pw@db/semantic",)})
    line = formatter.format(record)
    assert "pw@" not in line and "postgresql://sem:***@db/semantic" in line
    if isinstance(formatter, JsonFormatter):
        json.loads(line)

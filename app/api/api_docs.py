"""GET /openapi.json and GET /docs: this server's API reference, as a document and as a page.

The page is plain HTML made on the server (no scripts, nothing fetched from elsewhere):
every operation with its parameters, request body and answers, then every schema.
"""

from __future__ import annotations

import json
from html import escape
from typing import Any

import falcon

from app.api.openapi import build_document
from app.api.status_page import STYLE


class ApiDocument:
    """The app's OpenAPI document, built on first use: every route is registered by then."""

    def __init__(self, app: falcon.App, api_key_required: bool) -> None:
        self._app = app
        self._api_key_required = api_key_required
        self._document: dict[str, Any] | None = None

    def get(self) -> dict[str, Any]:
        if self._document is None:
            self._document = build_document(self._app, self._api_key_required)
        return self._document


class OpenApiResource:
    def __init__(self, document: ApiDocument) -> None:
        self._document = document

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        resp.media = self._document.get()


class DocsResource:
    def __init__(self, document: ApiDocument) -> None:
        self._document = document

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        resp.content_type = "text/html; charset=utf-8"
        resp.text = render_page(self._document.get())


def _ref_link(schema: dict[str, Any]) -> str:
    name = schema.get("$ref", "").rsplit("/", 1)[-1]
    return f'<a href="#schema-{escape(name)}">{escape(name)}</a>' if name else escape(json.dumps(schema))


def _operation_rows(document: dict[str, Any]) -> str:
    rows = []
    for path, methods in document["paths"].items():
        for method, op in methods.items():
            params = ", ".join(f"{escape(p['name'])} ({p['in']})" for p in op.get("parameters", []))
            body = op.get("requestBody")
            body_cell = (_ref_link(body["content"]["application/json"]["schema"])
                         + ("" if body["required"] else " (optional)")) if body else ""
            answers = "; ".join(
                f"{status}: " + (", ".join(answer.get("content", {})) or escape(answer["description"]))
                + (" " + _ref_link(answer["content"]["application/json"]["schema"])
                   if "$ref" in answer.get("content", {}).get("application/json", {}).get("schema", {}) else "")
                for status, answer in op["responses"].items())
            auth = "none" if op.get("security", document["security"]) == [] else "API key"
            rows.append(f'<tr id="op-{escape(op.get("operationId", ""))}"><td><b>{method.upper()}</b></td>'
                        f"<td><code>{escape(path)}</code></td><td>{escape(op['summary'])}"
                        f"{'<br>' + escape(op['description']) if op.get('description') else ''}</td>"
                        f"<td>{params}</td><td>{body_cell}</td><td>{answers}</td><td>{auth}</td></tr>")
    return "".join(rows)


def render_page(document: dict[str, Any]) -> str:
    """The document as one HTML page: the operations, the authentication, then every schema."""
    info = document["info"]
    schemes = document["components"]["securitySchemes"]
    auth = "".join(f"<li><code>{escape(s.get('name') or 'Authorization: Bearer')}</code>: "
                   f"{escape(s['description'])}</li>" for s in schemes.values())
    required = ("This server has an api_key: the operations marked so need it" if document["security"]
                else "This server has no api_key: no operation needs one. With one set")
    schemas = "".join(
        f'<details id="schema-{escape(name)}"><summary><code>{escape(name)}</code></summary>'
        f"<pre><code>{escape(json.dumps(schema, indent=2))}</code></pre></details>"
        for name, schema in document["components"]["schemas"].items())
    head = ("<tr><th>method</th><th>path</th><th>what</th><th>parameters</th><th>request body</th>"
            "<th>answers</th><th>auth</th></tr>")
    return ('<!doctype html><html lang="en"><head><meta charset="utf-8">'
            f"<title>{escape(info['title'])} API</title><style>{STYLE}</style></head><body>"
            f"<h1>{escape(info['title'])} {escape(info['version'])}: API</h1><p>{escape(info['description'])} "
            'As OpenAPI 3.1: <a href="/openapi.json">/openapi.json</a>. Back to <a href="/">the server</a>.</p>'
            f"<h2>Operations</h2><table>{head}{_operation_rows(document)}</table>"
            f"<h2>Authentication</h2><p>{required}, a client sends it as one of:</p><ul>{auth}</ul>"
            f"<h2>Schemas</h2>{schemas}</body></html>")

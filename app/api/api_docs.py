"""GET /openapi.json and GET /docs: this server's API reference, as a document and as a page.

The page is plain HTML made on the server (templates/docs.html; no scripts, nothing fetched from elsewhere):
every operation with its parameters, request body and answers, then every schema.
"""

from __future__ import annotations

import json
from typing import Any

import falcon

from app.api.openapi import build_document
from app.api.pages import render


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


def _ref(schema: dict[str, Any]) -> str:
    """The name of the schema ``schema`` refers to ("" when it is no reference)."""
    return schema.get("$ref", "").rsplit("/", 1)[-1]


def _operations(document: dict[str, Any]) -> list[dict[str, Any]]:
    """Each operation as the page's table shows it."""
    operations = []
    for path, methods in document["paths"].items():
        for method, op in methods.items():
            body = op.get("requestBody")
            schema = body["content"]["application/json"]["schema"] if body else {}
            operations.append({
                "id": op.get("operationId", ""), "method": method.upper(), "path": path, "summary": op["summary"],
                "description": op.get("description"),
                "parameters": [(p["name"], p["in"]) for p in op.get("parameters", [])],
                "body": body and {"ref": _ref(schema), "schema": json.dumps(schema), "required": body["required"]},
                "answers": [(status, ", ".join(answer.get("content", {})) or answer["description"],
                             _ref(answer.get("content", {}).get("application/json", {}).get("schema", {})))
                            for status, answer in op["responses"].items()],
                "auth": "none" if op.get("security", document["security"]) == [] else "API key"})
    return operations


def render_page(document: dict[str, Any]) -> str:
    """The document as one HTML page (templates/docs.html): the operations, the authentication,
    then every schema."""
    components = document["components"]
    return render("docs.html", info=document["info"], operations=_operations(document),
                  api_key_set=bool(document["security"]),
                  schemes=[(s.get("name") or "Authorization: Bearer", s["description"])
                           for s in components["securitySchemes"].values()],
                  schemas=[(name, json.dumps(schema, indent=2)) for name, schema in components["schemas"].items()])

"""The HTML pages are Jinja2 templates rendered with autoescape (app/api/pages.py): markup in a
value a page shows (an agent's id, a prompt's text in a cache miss, a description in the API
document) is shown as text, never run."""

from __future__ import annotations

from datetime import datetime

from app.api import api_docs, status_page
from app.store import cache_index, jobs, overview

EVIL = "<script>alert('x & \"y\"')</script>"
SHOWN = "&lt;script&gt;alert(&#39;x &amp; &#34;y&#34;&#39;)&lt;/script&gt;"


def test_the_status_and_docs_pages_escape_every_value() -> None:
    when = datetime(2026, 11, 1, 12, 0, 0)
    conversation = overview.ConversationRow(EVIL, 3, 10, "warm", when, overview.LastTurnCache("disk", EVIL, 5))
    status = status_page.render_page(status_page.PageData(
        {"model": EVIL, "status": "ok", "active": 1, "queue": 0, "pool_bytes": 0, "pool_budget": 0},
        cache_index.TierCounts(1, 2, 3), 0, 0, [overview.AgentRow(EVIL, EVIL, when, 4, 0.5, (conversation,))], {},
        [overview.MissRow("r", when, EVIL, EVIL, 1, 2, EVIL, EVIL, EVIL)],
        [jobs.JobRunView(EVIL, EVIL, when, None, {})]))
    document = {"info": {"title": EVIL, "version": "1", "description": EVIL}, "security": [],
                "components": {"securitySchemes": {"a": {"name": EVIL, "description": EVIL}},
                               "schemas": {"S": {"description": EVIL}}},
                "paths": {"/p": {"get": {"summary": EVIL, "description": EVIL, "operationId": "o",
                                         "parameters": [{"name": EVIL, "in": "query"}],
                                         "responses": {"200": {"description": EVIL}}}}}}
    docs = api_docs.render_page(document)
    # Each value where the page shows it: the status page's 12, the docs page's 9 (the title twice)
    # and once more in the schema's JSON (its quotes JSON-escaped, then HTML-escaped).
    for page, times in ((status, 12), (docs, 9)):
        assert "<script" not in page and page.count(SHOWN) == times, page
    assert docs.count("&lt;script&gt;alert(") == 10

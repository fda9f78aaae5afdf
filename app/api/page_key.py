"""A browser's way into the server's pages when an ``api_key`` is set.

``GET /`` shows a key form (templates/root.html); ``POST /session`` checks the key and sets
an HttpOnly, SameSite=Strict cookie that holds a token derived from the key (never the key itself).
``AuthMiddleware`` accepts that cookie for reading ``COOKIE_PAGES`` only, and only on a
same-origin or typed-in request (``Sec-Fetch-Site``): the API still wants the key in its
headers, and no other site's page can use the cookie (the browser does not send it
cross-site, and a request that says it is cross-site is not admitted by it).
"""

from __future__ import annotations

import hashlib
import hmac

import falcon

from app.errors import InvalidRequest, Unauthorized

KEY_FORM_PATH = "/session"
COOKIE = "semantic_pages"
COOKIE_PAGES = frozenset({"/status", "/docs", "/openapi.json"})
SAME_SITE_FETCHES = frozenset({"same-origin", "none"})  # none: typed in, a bookmark


def page_token(key: bytes) -> str:
    """The cookie's value for ``key``: it opens the pages, and it is not the key."""
    return hmac.new(key, b"semantic pages cookie", hashlib.sha256).hexdigest()


def cookie_admits(req: falcon.Request, key: bytes) -> bool:
    """Whether ``req`` reads a page with the page cookie, from the server's own pages or typed in."""
    if req.method not in ("GET", "HEAD") or req.path not in COOKIE_PAGES:
        return False
    if (req.get_header("SEC-FETCH-SITE") or "none") not in SAME_SITE_FETCHES:
        return False
    offered = req.cookies.get(COOKIE)
    return offered is not None and hmac.compare_digest(offered.encode(), page_token(key).encode())


class PageKeyResource:
    """``POST /session`` (the key form): the right key sets the page cookie and goes back to ``/``."""

    def __init__(self, api_key: str) -> None:
        self._key = api_key.encode()

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        form = req.get_media(default_when_empty={})
        offered = form.get("key") if isinstance(form, dict) else None
        if not isinstance(offered, str):
            raise InvalidRequest("send the form's key field")
        if not self._key or not hmac.compare_digest(offered.encode(), self._key):
            raise Unauthorized("invalid API key")
        resp.set_cookie(COOKIE, page_token(self._key), http_only=True, same_site="Strict", path="/",
                        secure=req.scheme == "https")
        resp.status = falcon.HTTP_303
        resp.location = "/"

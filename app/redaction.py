"""Secrets kept out of what Semantic prints and logs: the password of a URL, the value of a
secret-named query parameter or setting. Pure.

Settings such as ``database_url`` (``postgresql://user:PASSWORD@host/db``) and ``block_store``
end up in terminals, logs and bug reports (``semantic config``, ``semantic pool up``, the
error for a malformed URL); what is printed or logged goes through ``redact`` first.
"""

from __future__ import annotations

import re

MASK = "***"
# A URL's user information, ``scheme://user:PASSWORD@``: the password runs to the last "@"
# before whitespace (a malformed URL's unencoded "@" or "/" inside it stays masked too).
_USERINFO = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.\-]*:/*[^\s/@:]*):[^\s]*@")
# A setting or field whose value is a secret: ``api_key``, ``db_password``, ``secret_token``
# (not ``max_tokens``).
SECRET_NAME = re.compile(r"(?:^|_)(?:password|passwd|secret|token|api_key|access_key|credentials?)(?:$|_)",
                         re.IGNORECASE)
_SECRET_PARAM = re.compile(r"(?P<head>[?&;][^=&\s]*(?:password|passwd|secret|token|api_?key|access_?key)"
                           r"[^=&\s]*=)[^&\s]*", re.IGNORECASE)


def redact(text: str) -> str:
    """``text`` with the password of every URL in it and the value of every secret-named
    query parameter (``?password=...``) replaced by ``***``; the rest unchanged."""
    if ":" not in text and "=" not in text:
        return text
    text = _USERINFO.sub(rf"\g<head>:{MASK}@", text)
    return _SECRET_PARAM.sub(rf"\g<head>{MASK}", text)


def shown_setting(name: str, value: object) -> object:
    """A setting's value as printed: a secret-named one (``api_key``) only as set or not, a
    text with its URLs' passwords masked, anything else as it is."""
    if isinstance(value, str) and value and SECRET_NAME.search(name):
        return "(set, not shown)"
    return redact(value) if isinstance(value, str) else value

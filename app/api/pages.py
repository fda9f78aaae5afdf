"""The HTML pages (``/``, ``/docs``, ``/status``): Jinja2 templates in app/api/templates/,
rendered with autoescape, so every value a page shows (an agent's id, a prompt's text) is
escaped and only the templates' own markup is not."""

from __future__ import annotations

from typing import Any

from jinja2 import Environment, PackageLoader

TEMPLATES = Environment(loader=PackageLoader("app.api"), autoescape=True, trim_blocks=True, lstrip_blocks=True)


def render(template: str, **values: Any) -> str:
    return TEMPLATES.get_template(template).render(**values)

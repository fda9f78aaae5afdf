"""Turn a pydantic ValidationError into a field path and a message. Pure."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, Field, ValidationError

from app.errors import InvalidRequest

Model = TypeVar("Model", bound=BaseModel)

# A request's ``model``: a name, kept in ``requests.model`` (256 characters; PostgreSQL
# refuses longer values and NUL), so no control characters.
ModelName = Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[^\x00-\x1f\x7f]+$")]


def _field_path(loc: Sequence[str | int], data: Any) -> list[str]:
    """The parts of ``loc`` that are keys or indexes of the input itself.

    pydantic adds union member names and discriminator tags to locations; they
    are dropped by walking the input. A last part that is not there is the
    name of a missing field and is kept.
    """
    parts: list[str] = []
    current = data
    for i, part in enumerate(loc):
        if isinstance(current, dict) and part in current:
            current = current[part]
            parts.append(str(part))
        elif isinstance(current, list) and isinstance(part, int) and 0 <= part < len(current):
            current = current[part]
            parts.append(str(part))
        elif i == len(loc) - 1 and isinstance(current, dict) and isinstance(part, str):
            parts.append(part)
    return parts


def first_error(exc: ValidationError, data: Any) -> tuple[str, str]:
    """The most specific error as (``a.0.b`` field path, message)."""
    located = [(_field_path(e["loc"], data), e["msg"]) for e in exc.errors(include_url=False)]
    path, message = max(located, key=lambda item: len(item[0]))
    return (".".join(path) or "body"), message


def validate(model: type[Model], body: Any) -> Model:
    """``body`` as ``model``.

    Raises:
        InvalidRequest: naming the first offending field (``messages.0.content: Field required``).
    """
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        where, message = first_error(exc, body)
        raise InvalidRequest(f"{where}: {message}", where) from None

"""JSON schemas no finite value fits (issue 59, item 7): refused, while those that recurse
through an optional property, an array that may be empty or one finite alternative are not."""
from __future__ import annotations

from app.protocol.structured import endless

NODE = {"type": "object", "properties": {"child": {"$ref": "#/$defs/node"}}}


def test_a_required_recursion_is_endless_and_named() -> None:
    assert endless({"$defs": {"node": {**NODE, "required": ["child"]}}, "$ref": "#/$defs/node"}) == \
        "#/$defs/node -> #/$defs/node"
    assert endless({"type": "object", "properties": {"me": {"$ref": "#"}}, "required": ["me"]}) == "# -> #"
    both = {"anyOf": [{"$ref": "#/$defs/a"}, {"$ref": "#/$defs/a"}]}
    assert endless({"$defs": {"a": {"type": "object", "properties": {"x": both}, "required": ["x"]}},
                    "$ref": "#/$defs/a"}) is not None
    listed = {"type": "array", "items": {"$ref": "#/$defs/n"}, "minItems": 1}
    assert endless({"$defs": {"n": {"type": "object", "properties": {"kids": listed}, "required": ["kids"]}},
                    "$ref": "#/$defs/n"}) is not None


def test_recursions_that_can_end_are_not() -> None:
    assert endless({"$defs": {"node": NODE}, "$ref": "#/$defs/node"}) is None  # optional child
    maybe = {"anyOf": [{"$ref": "#/$defs/a"}, {"type": "null"}]}
    assert endless({"$defs": {"a": {"type": "object", "properties": {"x": maybe}, "required": ["x"]}},
                    "$ref": "#/$defs/a"}) is None
    empty_ok = {"type": "array", "items": {"$ref": "#/$defs/n"}}
    assert endless({"$defs": {"n": {"type": "object", "properties": {"kids": empty_ok}, "required": ["kids"]}},
                    "$ref": "#/$defs/n"}) is None
    assert endless({"type": "object"}) is None and endless({"$ref": "#/$defs/missing"}) is None


def test_objects_that_say_nothing_of_other_keys_are_closed_at_every_depth() -> None:
    """(issue 62: closed by default, as llama.cpp and Ollama hold schemas)."""
    from app.protocol.structured import closed

    point = {"type": "object", "properties": {"x": {"type": "integer"}}}
    schema = {"type": "object", "properties": {"at": point, "all": {"type": "array", "items": point}},
              "$defs": {"p": point}, "anyOf": [point]}
    shut = closed(schema)
    assert shut["additionalProperties"] is False
    assert shut["properties"]["at"]["additionalProperties"] is False
    assert shut["properties"]["all"]["items"]["additionalProperties"] is False
    assert shut["$defs"]["p"]["additionalProperties"] is False and shut["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in schema and "additionalProperties" not in point  # the request's is untouched
    assert closed({**point, "additionalProperties": True})["additionalProperties"] is True
    assert "additionalProperties" not in closed({**point, "patternProperties": {"^y": {}}})
    assert closed({"allOf": [point, {"properties": {"y": {}}}]}) == {"allOf": [point, {"properties": {"y": {}}}]}
    assert closed({"type": "object"}) == {"type": "object"}  # JSON mode: any object

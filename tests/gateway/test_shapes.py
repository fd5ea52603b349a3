"""Every field's type is checked before any parser reads it (gateway/requests/shapes.py). The sweep below builds
its cases from the shapes themselves: for every field and block the four APIs' parsers read, a body
that is well formed but for a value of the wrong type there, so a field added to a shape is covered
by construction. Each must parse or be refused with an ApiError (a 4xx), never raise anything else."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gateway.formats import anthropic_api, responses_api
from gateway.requests.errors import ApiError
from gateway.requests.schemas import CHAT_SHAPE, parse_chat_request
from gateway.requests.shapes import ANY, STR, Checked, Either, List, Obj, Shape, Tagged, _Scalar, check
from gateway.serving.embeddings import EMBEDDINGS_SHAPE, parse_embeddings_request
from gateway.settings import Limits

CONFUSING = {
    "null-in-list": None,
    "bool": True,
    "int": 7,
    "float": 1.5,
    "string": "x",
    "list": ["x"],
    "empty-list": [],
    "object": {"a": 1},
    "empty-object": {},
    "nested-list": [[{"type": []}]],
}
SAMPLES = {"a string": "x", "an integer": 1, "a number": 0.5, "true or false": False, "an object": {}}


def _sample(shape: Shape, kind: str | None = None):
    """A well-formed value of `shape` (for a tagged shape, of the kind named)."""
    if isinstance(shape, _Scalar):
        return SAMPLES[shape.label]
    if isinstance(shape, Either):
        return _sample(shape.shapes[-1] if isinstance(shape.shapes[-1], List) else shape.shapes[0])
    if isinstance(shape, List):
        return [_sample(shape.item)]
    if isinstance(shape, Tagged):
        kind = kind or next(iter(shape.kinds))
        return {shape.key: kind, **_sample(shape.kinds[kind])}
    if isinstance(shape, Obj):
        return {key: _sample(value) for key, value in shape.fields.items() if key != "type"}
    return "x"  # ANY


def _mutants(shape: Shape, value) -> Iterator[tuple[str, object]]:
    """(where, value) for every field under `shape` set to each confusing value, the rest well formed."""
    if isinstance(shape, Tagged):
        for kind, fields in shape.kinds.items():
            base = {shape.key: kind, **_sample(fields)}
            for where, changed in _mutants(fields, base):
                yield f"{kind}:{where}", {**changed, shape.key: kind}
            for name, wrong in CONFUSING.items():
                yield f"{kind}:type={name}", {**base, shape.key: wrong}
        return
    if isinstance(shape, Either):
        for option in shape.shapes:
            if option is not ANY:
                yield from _mutants(option, _sample(option))
        return
    if isinstance(shape, List) and isinstance(value, list) and value:
        for where, changed in _mutants(shape.item, value[0]):
            yield f"[0]{where}", [changed]
        yield "[null]", [None]
        return
    if isinstance(shape, Obj) and isinstance(value, dict):
        for key, field_shape in shape.fields.items():
            for name, wrong in CONFUSING.items():
                yield f".{key}={name}", {**value, key: wrong}
            for where, changed in _mutants(field_shape, value.get(key, _sample(field_shape))):
                yield f".{key}{where}", {**value, key: changed}


BASES = {
    "chat": ({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, CHAT_SHAPE),
    "messages": (
        {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
        anthropic_api.MESSAGE_SHAPE,
    ),
    "responses": ({"model": "m", "input": "hi"}, responses_api.RESPONSE_SHAPE),
    "embeddings": ({"model": "all-MiniLM-L6-v2", "input": "hi"}, EMBEDDINGS_SHAPE),
}
PARSERS = {
    "chat": lambda body: parse_chat_request(body, Limits()),
    "messages": lambda body: anthropic_api.parse_messages_request(body, Limits()),
    "responses": lambda body: responses_api.parse_request(body, None, Limits()),
    "embeddings": lambda body: parse_embeddings_request(body, Limits(), None),
}


def _cases() -> list[tuple[str, str, dict]]:
    cases = []
    for api, (base, shape) in BASES.items():
        for key, field_shape in shape.body.fields.items():
            for where, value in _mutants(Obj({key: field_shape}), {key: _sample(field_shape)}):
                cases.append((api, where, {**base, **value}))
    return cases


CASES = _cases()


def test_the_sweep_reaches_every_field_of_every_shape():
    assert len(CASES) > 3000
    for api, (_, shape) in BASES.items():
        reached = {where.split("=")[0].split(".")[1].split("[")[0] for a, where, _ in CASES if a == api}
        assert reached >= set(shape.body.fields), (api, set(shape.body.fields) - reached)


@pytest.mark.parametrize("api", sorted(BASES))
def test_a_value_of_the_wrong_type_anywhere_is_a_4xx_never_another_error(api):
    for where_api, where, body in CASES:
        if where_api != api:
            continue
        try:
            PARSERS[api](body)
        except ApiError as refused:
            assert 400 <= refused.status < 500, (where, refused.status)
        except Exception as exc:  # noqa: BLE001 - the point: nothing but ApiError may come out
            pytest.fail(f"{api} {where}: {type(exc).__name__}: {exc}")


def test_a_wrong_type_deep_in_a_body_is_named_by_its_path_in_the_apis_own_style():
    body = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]}
    with pytest.raises(ApiError) as openai_style:
        check(body, CHAT_SHAPE, "openai")
    assert openai_style.value.param == "messages[0].content[0].text"
    assert openai_style.value.message == "messages[0].content[0].text: must be a string; got a number"
    with pytest.raises(ApiError) as anthropic_style:
        check(body, anthropic_api.MESSAGE_SHAPE, "anthropic")
    assert anthropic_style.value.message.startswith("messages.0.content.0.text: must be a string")


def test_null_is_unset_in_an_object_and_wrong_in_a_list():
    shape = Checked(Obj({"a": STR, "b": List(STR)}))
    check({"a": None, "b": ["x"]}, shape, "openai")
    with pytest.raises(ApiError) as refused:
        check({"b": ["x", None]}, shape, "openai")
    assert refused.value.param == "b[1]"


def test_the_top_level_field_keeps_its_own_code():
    with pytest.raises(ApiError) as refused:
        check({"model": "m", "messages": "hi"}, CHAT_SHAPE, "openai")
    assert refused.value.code == "invalid_messages"

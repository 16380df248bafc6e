"""A request's grammar from the fields that can ask for one: OpenAI's `response_format`, vLLM's
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` and `structured_outputs`.
More than one is a 400; so is a json_schema format without its schema."""

from __future__ import annotations

from goodserve.errors import InvalidRequestError
from goodserve.structured_outputs import StructuredOutputsParams


def request_grammar(req) -> StructuredOutputsParams | None:
    asked = {}
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        asked["response_format"] = StructuredOutputsParams(json_object=True)
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise InvalidRequestError("response_format json_schema needs json_schema.schema")
        asked["response_format"] = grammar_of("response_format", json=fmt.json_schema.json_schema)
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                      ("guided_grammar", "grammar")):
        if getattr(req, name) is not None:
            asked[name] = grammar_of(name, **{key: getattr(req, name)})
    if req.structured_outputs is not None:
        so = req.structured_outputs
        asked["structured_outputs"] = grammar_of(
            "structured_outputs", json=so.json_, json_object=so.json_object, regex=so.regex, choice=so.choice,
            grammar=so.grammar)
    if len(asked) > 1:
        raise InvalidRequestError(f"a request takes one grammar; this one asks for {len(asked)}: "
                                  f"{', '.join(asked)}")
    return next(iter(asked.values()), None)


def grammar_of(field: str, **grammar) -> StructuredOutputsParams:
    """The grammar a request's field asks for; a bad one (past a bound, ...) is a 400 naming the field."""
    try:
        return StructuredOutputsParams(**grammar)
    except InvalidRequestError as exc:
        raise InvalidRequestError(f"{field}: {exc}") from None

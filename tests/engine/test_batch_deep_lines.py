"""A Batch API input line whose JSON nests deeper than the parser reads (json.loads raises
RecursionError) or than a request body may go: that line alone goes to the error file, and the valid
lines beside it are answered; through `goodserve batch run` over dummy:tiny and the server's parser."""

from __future__ import annotations

import json

from goodserve.cli import main
from goodserve.server.batch_lines import ENDPOINTS, parse_lines
from goodserve.server.limits import MAX_BODY_DEPTH


def completion(custom_id: str, prompt: object = (1, 2, 3)) -> str:
    body = {"prompt": "PROMPT", "max_tokens": 2, "ignore_eos": True}
    line = {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body}
    # written as text: json.dumps cannot write what json.loads cannot read
    return json.dumps(line).replace('"PROMPT"', prompt if isinstance(prompt, str) else json.dumps(list(prompt)))


DEEP = "[" * 5000 + "1" + "]" * 5000  # 5,000 levels: past json.loads's recursion limit
PAST_BODY_BOUND = "[" * (MAX_BODY_DEPTH + 1) + "1" + "]" * (MAX_BODY_DEPTH + 1)


def test_a_line_nested_too_deep_is_an_error_record_and_the_others_run(tmp_path):
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join([completion("a"), completion("deep", DEEP), completion("bound", PAST_BODY_BOUND),
                                 completion("b")]) + "\n")
    assert main(["batch", "run", str(source), str(output), "--model", "dummy:tiny", "--num-kv-blocks", "64"]) == 0
    records = [json.loads(x) for x in output.read_text().splitlines()]
    answered = {r["custom_id"]: r["response"]["body"]["usage"]["completion_tokens"] for r in records if r["response"]}
    errors = {r["error"]["line"]: r["error"]["message"] for r in records if r["error"]}
    assert answered == {"a": 2, "b": 2}
    assert set(errors) == {2, 3}
    assert "deeper than this server reads" in errors[2]
    assert f"nested more than {MAX_BODY_DEPTH} levels" in errors[3]


def test_the_servers_parser_keeps_the_lines_beside_a_deep_one():
    lines = parse_lines("\n".join([completion("a"), completion("deep", DEEP), completion("b")]).encode(), ENDPOINTS)
    assert [(x.custom_id, x.error is None) for x in lines] == [("a", True), (None, False), ("b", True)]

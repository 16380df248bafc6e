"""Per-token mask time and correctness of xgrammar and llguidance on the embedded model's vocabulary
(SmolLM2's 49,152 tokens), for a few json_schema grammars, on the CPU.

For each schema and engine: compile time, then a walk along a valid document's own tokens (each must
be allowed by the mask; EOS must be refused until the document is complete and allowed at its end),
and an invalid document, which must be refused at some token. A seeded random walk then picks, at
each step, a token both engines allow, and counts the steps where their masks differ (both compile
the same schema with the same separators, so their languages should be equal; the tokens where they
differ are listed). Timed: filling one
row of a [1, 1536] int32 bitmask per token (what the engine does per sequence per step).

    PYTHONPATH=src python benchmarks/grammar_mask.py     # writes $OUT/grammar_mask.json
"""

from __future__ import annotations

import importlib.metadata
import json
import platform
import random
import statistics
import time

import torch

from goodserve.model.tokenizer_loader import embedded_tokenizer
from result_file import write_result

SCHEMAS = {
    "flat": ({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]},
             {"name": "Ada Lovelace", "age": 36}, {"name": "Ada", "age": "36"}),
    "nested": ({"type": "object", "properties": {
        "id": {"type": "integer"}, "score": {"type": "number"},
        "status": {"enum": ["active", "inactive", "banned"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "owner": {"type": "object", "properties": {"email": {"type": "string"}, "admin": {"type": "boolean"}},
                  "required": ["email", "admin"]}},
        "required": ["id", "score", "status", "tags", "owner"]},
        {"id": 17, "score": -3.25, "status": "inactive", "tags": ["red", "green blue"],
         "owner": {"email": "a@b.org", "admin": False}},
        {"id": 17, "score": -3.25, "status": "deleted", "tags": [], "owner": {"email": "x", "admin": False}}),
    "tool_call": ({"type": "object", "properties": {
        "name": {"const": "get_weather"},
        "arguments": {"type": "object", "properties": {
            "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 14}}, "required": ["city", "unit"]}},
        "required": ["name", "arguments"]},
        {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius", "days": 3}},
        {"name": "get_time", "arguments": {"city": "Paris", "unit": "celsius"}}),
    "list_of_items": ({"type": "array", "minItems": 1, "maxItems": 5, "items": {
        "type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                                         "qty": {"type": "integer"}}, "required": ["sku", "qty"]}},
        [{"sku": "ABC-1234", "qty": 2}, {"sku": "XYZ-0001", "qty": 10}],
        [{"sku": "abc-1234", "qty": 2}]),
}
RANDOM_STEPS = 48
# json.dumps' separators, no other whitespace: both engines then accept the same language.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int):
        import llguidance
        import llguidance.torch

        self.ll, self.fill_row = llguidance, llguidance.torch.fill_next_token_bitmask
        self.tokenizer = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size,
                                                eos_token=tokenizer.eos_token_ids)

    def matcher(self, schema: dict):
        grammar = self.ll.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        matcher = self.ll.LLMatcher(self.tokenizer, grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def fill(self, matcher, bitmask):
        self.fill_row(matcher, bitmask, 0)

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int):
        import xgrammar

        self.xgr = xgrammar
        meta = xgrammar.TokenizerInfo._detect_metadata_from_hf(tokenizer.backend.to_str())
        # Special tokens as "": xgrammar then never allows them (with their text it would allow
        # <|im_start|> inside a JSON string, as its from_huggingface does).
        vocab = ["" if i in tokenizer.special_token_ids else tokenizer.id_to_token(i) or ""
                 for i in range(tokenizer.vocab_size)]
        info = xgrammar.TokenizerInfo(vocab, meta["vocab_type"], vocab_size=vocab_size,
                                      stop_token_ids=tokenizer.eos_token_ids,
                                      add_prefix_space=meta["add_prefix_space"])
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1)

    def matcher(self, schema: dict):
        compiled = self.compiler.compile_json_schema(schema, any_whitespace=False)
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher, bitmask):
        matcher.fill_next_token_bitmask(bitmask, 0)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)


def allowed(bitmask: torch.Tensor, token: int) -> bool:
    return bool((int(bitmask[0, token // 32]) >> (token % 32)) & 1)


def walk_document(engine, schema: dict, tokens: list[int], eos: int, bitmask) -> dict:
    """Follow a document's tokens: each must be allowed, EOS only at the end; time each mask."""
    t0 = time.perf_counter()
    matcher = engine.matcher(schema)
    compile_ms = (time.perf_counter() - t0) * 1e3
    times, refused_at, early_eos = [], None, False
    for i, token in enumerate(tokens + [eos]):
        t0 = time.perf_counter()
        engine.fill(matcher, bitmask)
        times.append(time.perf_counter() - t0)
        if not allowed(bitmask, token):
            refused_at = i
            break
        early_eos |= i < len(tokens) and allowed(bitmask, eos)
        if i < len(tokens):
            assert engine.accept(matcher, token)
    return {"compile_ms": compile_ms, "mask_us": [t * 1e6 for t in times], "refused_at": refused_at,
            "eos_allowed_early": early_eos}


def allowed_set(bitmask: torch.Tensor, vocab_size: int) -> set[int]:
    bits = ((bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:vocab_size]
    return set(bits.nonzero().flatten().tolist())


def random_walk(engines, tokenizer, schema: dict, eos: int, vocab_size: int, seed: int) -> dict:
    """Tokens both engines allow, picked at random; count the steps where their masks differ."""
    rng = random.Random(seed)
    matchers = [e.matcher(schema) for e in engines]
    masks = [torch.zeros(1, (vocab_size + 31) // 32, dtype=torch.int32) for _ in engines]
    differing, steps, only = 0, 0, [set(), set()]
    for _ in range(RANDOM_STEPS):
        for engine, matcher, mask in zip(engines, matchers, masks):
            engine.fill(matcher, mask)
        differing += not torch.equal(masks[0], masks[1])
        sets = [allowed_set(mask, vocab_size) for mask in masks]
        only[0] |= sets[0] - sets[1]
        only[1] |= sets[1] - sets[0]
        choices = sorted(sets[0] & sets[1] - {eos})
        if not choices:
            break
        token = rng.choice(choices)
        for engine, matcher in zip(engines, matchers):
            assert engine.accept(matcher, token)
        steps += 1
    return {"steps": steps, "steps_masks_differ": differing,
            **{f"tokens_only_{e.name}_allows": [tokenizer.id_to_token(t) for t in sorted(o)[:8]]
               for e, o in zip(engines, only)}}


def main() -> None:
    tokenizer = embedded_tokenizer()
    vocab_size = tokenizer.vocab_size
    eos = tokenizer.eos_token_ids[0]
    engines, setup_ms = [], {}
    for cls in (LLGuidance, XGrammar):
        t0 = time.perf_counter()
        engines.append(cls(tokenizer, vocab_size))
        setup_ms[cls.name] = (time.perf_counter() - t0) * 1e3
    bitmask = torch.zeros(1, (vocab_size + 31) // 32, dtype=torch.int32)
    results = {}
    for name, (schema, valid, invalid) in SCHEMAS.items():
        valid_tokens = tokenizer.encode(json.dumps(valid), add_special_tokens=False)
        invalid_tokens = tokenizer.encode(json.dumps(invalid), add_special_tokens=False)
        row = {"valid_tokens": len(valid_tokens)}
        for engine in engines:
            runs = [walk_document(engine, schema, valid_tokens, eos, bitmask) for _ in range(3)]
            bad = walk_document(engine, schema, invalid_tokens, eos, bitmask)
            per_token = [statistics.median(step) for step in zip(*(r["mask_us"] for r in runs))]
            row[engine.name] = {
                "compile_ms_first": runs[0]["compile_ms"], "compile_ms_again": runs[-1]["compile_ms"],
                "mask_us_median": statistics.median(per_token), "mask_us_mean": statistics.mean(per_token),
                "mask_us_max": max(per_token),
                "valid_accepted": runs[0]["refused_at"] is None and not runs[0]["eos_allowed_early"],
                "invalid_refused_at_token": bad["refused_at"],
            }
        row["random_walk"] = random_walk(engines, tokenizer, schema, eos, vocab_size, seed=len(name))
        results[name] = row
        print(name, json.dumps(row, default=float))
    result = {"machine": "Intel Xeon, 2 cores", "cpu": platform.processor() or platform.machine(),
              "torch_threads": torch.get_num_threads(), "vocab_size": vocab_size,
              "versions": {e.name: importlib.metadata.version(e.name) for e in engines},
              "tokenizer_setup_ms": setup_ms, "schemas": results}
    write_result("grammar_mask.json", result)


if __name__ == "__main__":
    main()

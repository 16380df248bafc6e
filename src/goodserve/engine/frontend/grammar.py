"""Grammar-constrained decoding with xgrammar: a request's grammar is compiled once (a cache keyed by
the grammar), each of its sequences gets its own matcher, and each step the matchers of the
sequences that sample fill a token bitmask on the host (ops/token_bitmask.py applies it).

Why xgrammar (benchmarks/grammar_mask.py, on this vocabulary): a mask costs about 1 µs per token
against llguidance's 8-17 µs, both accept every valid document and refuse invalid ones at the same
token. Special tokens enter its vocabulary as "" so no grammar ever allows them (given their text,
xgrammar would allow <|im_start|> inside a JSON string). xgrammar is imported on the first grammar
request: an engine that never sees one never loads it.
"""

from __future__ import annotations

import functools
import json
import re
import threading
from collections import OrderedDict

import torch

from goodserve.engine.worker.sampling_inputs import GrammarBitmask
from goodserve.engine.core.sequence import Sequence
from goodserve.errors import InvalidRequestError
from goodserve.structured_outputs import StructuredOutputsParams

_SOURCE_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
COMPILE_CACHE_SIZE = 256  # compiled grammars kept (each holds its token-mask cache: ~100 KB-1 MB)


class GrammarError(RuntimeError):
    """A sampled token the sequence's grammar refuses (the mask should make it impossible)."""


class GrammarCompiler:
    def __init__(self, tokenizer, vocab_size: int) -> None:
        import xgrammar

        self.xgr = xgrammar
        meta = xgrammar.TokenizerInfo._detect_metadata_from_hf(tokenizer.backend.to_str())
        special = tokenizer.special_token_ids
        # Masks span the tokenizer's tokens; the sampler bans a larger model vocabulary's rest (a dummy
        # model's 128k rows beside the embedded 49k tokenizer). Padding xgrammar's vocabulary to the
        # model's instead made each fill check 79k empty tokens: a mixed batch on the H100 ran at 0.63
        # of free throughput, 0.94 without them (benchmarks/BENCHMARKS.md).
        self.vocab_size = min(tokenizer.vocab_size, vocab_size)
        vocab = ["" if i in special else tokenizer.id_to_token(i) or "" for i in range(self.vocab_size)]
        info = xgrammar.TokenizerInfo(vocab, meta["vocab_type"], vocab_size=self.vocab_size,
                                      stop_token_ids=tokenizer.eos_token_ids,
                                      add_prefix_space=meta["add_prefix_space"])
        self.info = info
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._lock = threading.Lock()  # the server validates (compiles) on its own thread

    def compile(self, spec: StructuredOutputsParams):
        key = spec.key
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        return self._remember(key, self._compile(spec))

    def serialized(self, spec: StructuredOutputsParams) -> str:
        """The compiled grammar as text, to cross to the engine's process (a CompiledGrammar does not
        pickle). Made for each send, not kept: it is several times the size of its source."""
        return self.compile(spec).serialize_json()

    def adopt(self, spec: StructuredOutputsParams, text: str) -> None:
        """Take a grammar compiled in another process (serialized()): loading it costs milliseconds
        where compiling it may cost seconds, and the engine's step loop waits for either."""
        with self._lock:
            if spec.key in self._cache:
                return
        self._remember(spec.key, self.xgr.CompiledGrammar.deserialize_json(text, self.info))

    def _remember(self, key: tuple[str, str], compiled):
        with self._lock:
            self._cache[key] = compiled
            if len(self._cache) > COMPILE_CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredOutputsParams):
        kind, source = spec.key
        try:
            if kind == "json":
                schema = json.loads(source)
                if not isinstance(schema, dict):
                    raise ValueError("a JSON schema is an object")
                return self.compiler.compile_json_schema(schema, any_whitespace=False)
            if kind == "json_object":  # strict_mode off: any keys, any values
                return self.compiler.compile_json_schema({"type": "object"}, any_whitespace=False,
                                                         strict_mode=False)
            if kind == "regex":
                return self.compiler.compile_regex(source)
            if kind == "choice":
                rule = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in spec.choice)
                return self.compiler.compile_grammar(f"root ::= {rule}")
            return self.compiler.compile_grammar(source)
        except Exception as exc:  # xgrammar raises RuntimeError / ValueError with the parser's message
            name = {"json": "JSON schema", "choice": "choice list", "grammar": "grammar"}.get(kind, kind)
            lines = str(exc).strip().splitlines() or [type(exc).__name__]
            message = _SOURCE_PREFIX.sub("", lines[0])  # "[17:45:19] /project/cpp/x.cc:83: " says nothing to users
            raise InvalidRequestError(f"invalid {name}: {message}") from None

    def new_state(self, compiled) -> GrammarState:
        return GrammarState(self.xgr.GrammarMatcher(compiled), self.vocab_size)


class GrammarState:
    """A sequence's matcher, and how many of its output tokens it has taken: with async scheduling
    it takes a step's token (accept_tokens_ahead) before the engine appends it (accept_token)."""

    def __init__(self, matcher, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size  # the tokens its mask covers
        self.num_accepted = 0

    def accept(self, token: int) -> None:
        if not self.matcher.accept_token(token):  # a refused token leaves the matcher as it was
            raise GrammarError(f"sampled token {token} is not allowed by the request's grammar")
        self.num_accepted += 1


def accept_token(seq: Sequence, token: int) -> bool:
    """Advance seq's matcher by its just-appended token (unless it took it ahead); True when the
    grammar has terminated (it accepted its stop token). A refused token raises: it fails the
    request, not the step."""
    if seq.grammar.num_accepted < seq.num_output_tokens:
        seq.grammar.accept(token)
    return seq.grammar.matcher.is_terminated()


def accept_tokens_ahead(seqs: list[Sequence], output) -> None:
    """Async scheduling: the tokens of the step in flight (a ModelRunnerOutput over seqs' rows), not
    appended yet, so the next step's masks can be filled while that step's forward runs."""
    for row, tokens in zip(output.sample_rows, output.token_ids):
        seq = seqs[row]
        for i, token in enumerate(tokens):
            if seq.grammar is not None and not seq.is_finished and \
                    seq.grammar.num_accepted == seq.num_output_tokens + i:
                seq.grammar.accept(token)


@functools.cache
def _batch_matcher():
    """xgrammar's batch filler: one thread pool for the process, one thread a core."""
    import xgrammar

    return xgrammar.BatchGrammarMatcher(max_threads="auto")


def grammar_bitmask(seqs: list[Sequence], pinned: bool) -> GrammarBitmask | None:
    """Bitmask rows (bit t of row r: token t allowed; tokens past the grammar vocabulary are not)
    for the sequences that have a grammar, and their row numbers in seqs; None when none has one."""
    rows = [row for row, seq in enumerate(seqs) if seq.grammar is not None]
    if not rows:
        return None
    vocab_size = seqs[rows[0]].grammar.vocab_size
    # Pinned, so the copies do not wait for the forward running on the stream (torch keeps a pinned
    # block from reuse until its copy is done).
    bitmask = torch.full((len(rows), (vocab_size + 31) // 32), -1, dtype=torch.int32, pin_memory=pinned)
    # A terminated matcher's row (a spare row of a pipelined step: its token is never used) stays all
    # ones; the others are filled together, on xgrammar's threads.
    live = [i for i, row in enumerate(rows) if not seqs[row].grammar.matcher.is_terminated()]
    if live:
        _batch_matcher().batch_fill_next_token_bitmask([seqs[rows[i]].grammar.matcher for i in live], bitmask, live)
    return GrammarBitmask(bitmask, None if len(rows) == len(seqs) else rows)

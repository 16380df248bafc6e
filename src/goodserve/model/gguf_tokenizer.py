"""A GGUF file's tokenizer (llama.cpp's vocabulary, merges and pre-tokenizer name) as a Hugging Face
`tokenizers` backend: byte-level BPE ('gpt2') or SentencePiece BPE ('llama'). No torch: the bench
reads it too."""

from __future__ import annotations

import gguf
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from goodserve.errors import ModelLoadError
from goodserve.model.gguf_reader import eos_token_ids, metadata
from goodserve.model.tokenizer import Tokenizer

# llama.cpp token types (tokenizer.ggml.token_type).
_CONTROL, _USER_DEFINED = 3, 4

# Split patterns per tokenizer.ggml.pre, as llama.cpp (llama-vocab.cpp) pre-tokenizes.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def gguf_tokenizer(reader: gguf.GGUFReader) -> Tokenizer:
    kind = metadata(reader, "tokenizer.ggml.model")
    tokens: list[str] = metadata(reader, "tokenizer.ggml.tokens")
    token_types = metadata(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in metadata(reader, "tokenizer.ggml.merges", [])]
    if kind == "gpt2":
        backend = HFTokenizer(models.BPE(vocab=_byte_level_vocab(tokens), merges=merges, fuse_unk=False))
        _set_pre_tokenizer(backend, metadata(reader, "tokenizer.ggml.pre", "default"))
        backend.decoder = decoders.ByteLevel()
    elif kind == "llama":
        scores = metadata(reader, "tokenizer.ggml.scores") or [0.0] * len(tokens)
        backend = _sentencepiece_bpe(tokens, scores, merges, metadata(reader, "tokenizer.ggml.add_space_prefix", True))
    else:
        raise ModelLoadError(
            f"GGUF tokenizer model {kind!r} is not supported; supported: 'gpt2' (byte-level BPE), "
            "'llama' (SentencePiece BPE)"
        )
    backend.add_special_tokens([
        AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, token_types) if k == _CONTROL
    ])
    backend.add_tokens([
        AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, token_types) if k == _USER_DEFINED
    ])
    return Tokenizer(
        backend,
        bos_token_id=metadata(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=eos_token_ids(reader),
        chat_template=metadata(reader, "tokenizer.chat_template"),
        # llama.cpp adds BOS to a SentencePiece vocabulary unless the file says otherwise.
        add_bos_token=bool(metadata(reader, "tokenizer.ggml.add_bos_token", kind == "llama")),
    )


def _sentencepiece_bpe(tokens: list[str], scores: list[float], merges: list[tuple[str, str]],
                       add_space_prefix: bool) -> HFTokenizer:
    """Llama-2 / Mistral style: "▁" for spaces, unknown bytes as <0xNN> tokens."""
    vocab = {token: i for i, token in enumerate(tokens)}
    merges = merges or _merges_from_scores(vocab, scores)
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if add_space_prefix else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _merges_from_scores(vocab: dict[str, int], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece files list no merges: every split of a token into two vocabulary pieces is a
    merge, ranked by the merged token's score (higher first), as transformers derives them."""
    candidates = []
    for token, score in zip(vocab, scores):
        splits = [(token[:i], token[i:]) for i in range(1, len(token))]
        splits = sorted(
            ((left, right) for left, right in splits if left in vocab and right in vocab),
            key=lambda pair: (vocab[pair[0]], vocab[pair[1]]),
        )
        candidates += [(left, right, score) for left, right in splits]
    candidates.sort(key=lambda c: (c[2], len(c[0]), len(c[1])), reverse=True)
    return [(left, right) for left, right, _ in candidates]


def _byte_level_vocab(tokens: list[str]) -> dict[str, int]:
    """Tokens already spelled in the byte-level alphabet stay; others (rare mislabels) are re-spelled."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_to_char = _bytes_to_unicode()
    return {
        token if set(token) <= set(alphabet) else "".join(byte_to_char[b] for b in token.encode()): i
        for i, token in enumerate(tokens)
    }


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _set_pre_tokenizer(backend: HFTokenizer, pre: str) -> None:
    """Split text the way the merges were learned, keyed by llama.cpp's pre-tokenizer name."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in ("smollm", "starcoder", "refact"):
        # Digits alone, then GPT-2's split (ByteLevel's own regex).
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    elif pre in ("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx"):
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"), byte_level]
        )
    elif pre in ("qwen2", "deepseek-r1-qwen"):
        backend.normalizer = normalizers.NFC()
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated"), byte_level]
        )
    else:  # "default", "gpt2" and unknown names: GPT-2's split
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)

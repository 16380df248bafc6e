"""A GGUF file's header: the reader and the metadata both the model loader and the tokenizer read."""

from __future__ import annotations

from pathlib import Path

import gguf

from goodserve.errors import ModelLoadError


def open_gguf(path: Path) -> gguf.GGUFReader:
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the reader raises bare ValueError/struct errors on a corrupt file
        raise ModelLoadError(f"cannot read GGUF file {path}: {e}") from e


def metadata(reader: gguf.GGUFReader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def eos_token_ids(reader: gguf.GGUFReader) -> list[int]:
    ids = [metadata(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    return list(dict.fromkeys(i for i in ids if i is not None))

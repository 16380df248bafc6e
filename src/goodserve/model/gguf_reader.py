"""A GGUF file's header: the reader and the metadata both the model loader and the tokenizer read."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import gguf
import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from goodserve.errors import ModelLoadError


class _TruncatedFile(ValueError):
    pass


class _SizeCheckedReader(gguf.GGUFReader):
    """Checks, before mapping the tensors, that the file holds all their bytes: a cut-short download
    otherwise fails deep in numpy ("cannot reshape array of size ...")."""

    def _build_tensors(self, start_offs: int, fields) -> None:
        expected = 0  # (a file of metadata alone may end before the aligned data offset)
        for field in fields:
            _name_len, _name, _n_dims, dims, raw_dtype, offset = field.parts
            block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(raw_dtype[0])]
            n_bytes = int(np.prod(dims)) * type_size // block_size
            expected = max(expected, start_offs + int(offset[0]) + n_bytes)
        if expected > self.data.size:
            raise _TruncatedFile(f"the file is truncated: expected {expected} bytes, has {self.data.size}")
        super()._build_tensors(start_offs, fields)


def open_gguf(path: Path) -> gguf.GGUFReader:
    """The file's reader, read once per process while the file stays the same: eval and tune build
    several engines of one file, a server its tokenizer and model, and parsing the header is most of
    a small model's load (~1.5 s of the embedded model's ~3 s). The reader maps the file read-only."""
    try:
        stat = os.stat(path)
    except OSError as e:
        raise ModelLoadError(f"cannot read GGUF file {path}: {e}") from e
    return _cached_reader(str(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4)
def _cached_reader(path: str, _mtime_ns: int, _size: int) -> gguf.GGUFReader:
    try:
        return _SizeCheckedReader(path)
    except _TruncatedFile as e:
        raise ModelLoadError(f"cannot read GGUF file {path}: {e} (download it again)") from e
    except Exception as e:  # the reader raises bare ValueError/struct errors on a corrupt file
        raise ModelLoadError(f"cannot read GGUF file {path}: {e}") from e


def metadata(reader: gguf.GGUFReader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def eos_token_ids(reader: gguf.GGUFReader) -> list[int]:
    ids = [metadata(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    return list(dict.fromkeys(i for i in ids if i is not None))

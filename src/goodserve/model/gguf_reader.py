"""A GGUF file's header: the reader and the metadata both the model loader and the tokenizer read."""

from __future__ import annotations

import functools
import os
import struct
import sys
from pathlib import Path

import gguf
import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from goodserve.errors import ModelLoadError


class _TruncatedFile(ValueError):
    pass


class _SizeCheckedReader(gguf.GGUFReader):
    """Checks, before mapping the tensors, that the file holds all their bytes: a cut-short download
    otherwise fails deep in numpy ("cannot reshape array of size ...").

    Also reads arrays of scalars and strings (a tokenizer's vocabulary, scores and merges: ~150,000
    items in a 50k vocabulary) in bulk: gguf's reader takes each item as a slice of the memory map,
    which costs several seconds a file, most of a small model's load. The parts it builds hold the
    same values (fields' contents() are unchanged), as plain arrays copied out of the map."""

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

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        if raw_type != gguf.GGUFValueType.ARRAY or self.byte_order != "I" or sys.byteorder != "little":
            return super()._get_field_parts(orig_offs, raw_type)
        head = [self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)]
        item_type, count = gguf.GGUFValueType(int(head[0][0])), int(head[1][0])
        start = orig_offs + 12
        if item_type == gguf.GGUFValueType.STRING:
            spans = _string_spans(memoryview(self.data), start, count)
            end = spans[-1][1] if spans else start
            if end > self.data.size:
                raise ValueError(f"a string array at byte {orig_offs} runs past the end of the file")
            region = np.array(self.data[start:end])  # one copy; its slices are plain arrays
            items = [region[a - start:b - start] for a, b in spans]
        elif (nptype := self.gguf_scalar_to_np.get(item_type)) is not None:
            end = start + count * np.dtype(nptype).itemsize
            if end > self.data.size:
                raise ValueError(f"an array at byte {orig_offs} runs past the end of the file")
            values = np.array(self._get(start, nptype, count))
            items = [values[i:i + 1] for i in range(count)]
        else:  # arrays of arrays: gguf's own walk
            return super()._get_field_parts(orig_offs, raw_type)
        types = [gguf.GGUFValueType.ARRAY] + ([item_type] if count else [])  # as gguf types an empty array
        return end - orig_offs, head + items, list(range(2, 2 + count)), types


def _string_spans(buffer: memoryview, offset: int, count: int) -> list[tuple[int, int]]:
    """(start, end) of each of count GGUF strings (a little-endian uint64 length, then the bytes)."""
    spans = []
    for _ in range(count):
        (length,) = struct.unpack_from("<Q", buffer, offset)
        spans.append((offset + 8, offset + 8 + length))
        offset += 8 + length
    return spans


def open_gguf(path: Path) -> gguf.GGUFReader:
    """The file's reader, read once per process while the file stays the same: eval and tune build
    several engines of one file, a server its tokenizer and model. The reader maps the file read-only."""
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

"""Commands check their flags and files before they load a model: a mistake is a one-line message
naming the flag or file (exit status 2), never a traceback after seconds of loading. The engine's
constructors are replaced by a guard that fails the test if any command gets that far."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from goodserve.cli import main
from goodserve.engine.frontend import async_engine, engine

TINY = ["--model", "dummy:tiny"]


@pytest.fixture(autouse=True)
def no_model_loads(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the flags were checked")

    monkeypatch.setattr(engine.Engine, "__init__", refuse)
    monkeypatch.setattr(async_engine.AsyncEngine, "__init__", refuse)


def error_of(argv: list[str], capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize("flags, message", [
    (["--temperature", "-1"], "temperature must be in [0, 100], got -1.0"),
    (["--max-tokens", "-5"], "max_tokens must be an integer in [0,"),
    (["--top-p", "5"], "top_p must be in (0, 1], got 5.0"),
    (["--max-model-len", "0"], "max_model_len must be at least 1"),
])
def test_generate_refuses_bad_sampling_flags(flags, message, capsys):
    assert message in error_of(["generate", "--prompt", "hi", *TINY, *flags], capsys)


def test_batch_run_names_a_missing_input_file(tmp_path, capsys):
    missing = tmp_path / "missing.jsonl"
    err = error_of(["batch", "run", str(missing), str(tmp_path / "out.jsonl"), *TINY], capsys)
    assert f"batch input file {missing}: no such file" in err


def test_batch_run_names_an_output_file_without_a_directory(tmp_path, capsys):
    source = tmp_path / "in.jsonl"
    source.write_text("{}\n")
    err = error_of(["batch", "run", str(source), str(tmp_path / "nowhere" / "out.jsonl"), *TINY], capsys)
    assert "its directory does not exist" in err


def test_max_model_len_past_the_models_window_is_refused(capsys):
    # dummy:tiny's window is 1,024 positions (model/presets.py).
    err = error_of(["generate", "--prompt", "hi", *TINY, "--max-model-len", "100000"], capsys)
    assert "--max-model-len 100000 is longer than the model's context window (1024 tokens)" in err


def test_serve_checks_the_context_length_before_loading(capsys):
    err = error_of(["serve", *TINY, "--max-model-len", "4096", "--no-engine-process"], capsys)
    assert "context window (1024 tokens)" in err


def test_a_missing_model_path_is_named(tmp_path, capsys):
    err = error_of(["generate", "--prompt", "hi", "--model", str(tmp_path / "absent.gguf")], capsys)
    assert f"{tmp_path / 'absent.gguf'}: no such file or directory" in err


def write_one_tensor_gguf(path):
    """A GGUF file whose one tensor (16 KiB of zeros, a multiple of the alignment) ends it."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("token_embd.weight", np.zeros((64, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_truncated_gguf_says_how_many_bytes_it_lacks(tmp_path, capsys):
    path = tmp_path / "tiny.gguf"
    write_one_tensor_gguf(path)
    full = path.stat().st_size  # the one tensor ends the file, its 16 KiB a multiple of the alignment
    path.write_bytes(path.read_bytes()[:full - 8000])
    err = error_of(["generate", "--prompt", "hi", "--model", str(path)], capsys)
    assert f"the file is truncated: expected {full} bytes, has {full - 8000}" in err

"""What a command checks before it loads a model: its flags' ranges and the files they name. A
mistake then costs a one-line message, not the seconds a load takes and a traceback after it."""

from __future__ import annotations

import argparse
from pathlib import Path

from goodserve.config import SELF_DRAFT_PREFIX, EngineConfig
from goodserve.engine.setup.config_resolution import check_context_length
from goodserve.engine_args import engine_config_from_args
from goodserve.errors import InvalidRequestError, ModelLoadError
from goodserve.model.loader import load_spec
from goodserve.model_names import model_path


def checked_engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine flags as a config, its ranges, the files it names and the context length checked."""
    config = engine_config_from_args(args)
    check_engine_config(config)
    return config


def check_engine_config(config: EngineConfig) -> None:
    """The model's files (missing, unreadable, a truncated GGUF) and the context length against the
    model's: all from headers and config files, no weights read."""
    files = (("--model", model_path(config.model)), ("--tokenizer", config.tokenizer),
             ("--quantized-checkpoint", config.quantized_checkpoint))
    for flag, path in files:
        if path and not Path(path).expanduser().exists():
            raise ModelLoadError(f"{flag} {path}: no such file or directory")
    if config.step_trace and not Path(config.step_trace).expanduser().parent.is_dir():
        raise InvalidRequestError(f"--step-trace {config.step_trace}: its directory does not exist")
    check_context_length(config.max_model_len, load_spec(config.model))
    if config.speculative_model and not config.speculative_model.startswith(SELF_DRAFT_PREFIX):
        load_spec(config.speculative_model)


def check_input_file(path: Path, what: str) -> None:
    if not path.is_file():
        raise InvalidRequestError(f"{what} {path}: {'is a directory' if path.is_dir() else 'no such file'}")


def check_output_file(path: Path, what: str) -> None:
    if path.is_dir() or not path.absolute().parent.is_dir():
        problem = "is a directory" if path.is_dir() else "its directory does not exist"
        raise InvalidRequestError(f"{what} {path}: {problem}")

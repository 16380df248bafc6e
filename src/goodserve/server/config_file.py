"""`goodserve serve --config FILE`: the serve options as a JSON object, e.g. the one `goodserve tune`
writes: {"model": "smollm2-135m", "quantization": "gguf", "max_num_seqs": 64}.

Keys are the flags' names (max_num_seqs or max-num-seqs); each value is checked as the flag's would
be (its type, its choices), so a typo or a wrong value is refused before any model loads. A flag
given on the command line with a value other than its default wins over the file.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from goodserve.errors import InvalidRequestError

_NOT_IN_FILE = {"config", "func", "help"}


def read_config_file(path: str) -> dict:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InvalidRequestError(f"--config {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidRequestError(f"--config {path}: cannot read it ({exc})") from None
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"--config {path}:{exc.lineno}: not valid JSON ({exc.msg})") from None
    if not isinstance(data, dict):
        raise InvalidRequestError(f"--config {path}: expected a JSON object of option names and values")
    return data


def apply_config_file(args: argparse.Namespace, parser: argparse.ArgumentParser, path: str) -> None:
    """Set each option the file names on args, where the command line left it at its default."""
    actions = {a.dest: a for a in parser._actions if a.option_strings and a.dest not in _NOT_IN_FILE}
    for key, value in read_config_file(path).items():
        dest = key.replace("-", "_")
        if dest not in actions:
            raise InvalidRequestError(f"--config {path}: unknown option {key!r} (the file's keys are serve's "
                                      f"flags, e.g. max_num_seqs)")
        action = actions[dest]
        typed = _checked(action, value, f"--config {path}: {key}")
        if getattr(args, dest) == action.default:
            setattr(args, dest, typed)


def _checked(action: argparse.Action, value, where: str):
    if value is None:
        return None
    if isinstance(action, (argparse.BooleanOptionalAction, argparse._StoreTrueAction, argparse._StoreFalseAction)):
        if not isinstance(value, bool):
            raise InvalidRequestError(f"{where}: expected true or false, got {value!r}")
        return value
    if isinstance(value, (bool, dict, list)):
        raise InvalidRequestError(f"{where}: expected a single value, got {value!r}")
    try:
        typed = action.type(value) if action.type else value
    except (TypeError, ValueError):
        raise InvalidRequestError(f"{where}: {value!r} is not a valid {action.type.__name__}") from None
    if action.type is int and typed != value:  # 1.5 -> 1 would pass silently
        raise InvalidRequestError(f"{where}: expected an integer, got {value!r}")
    if action.choices is not None and typed not in action.choices:
        raise InvalidRequestError(f"{where}: {typed!r} is not one of {', '.join(map(str, action.choices))}")
    return typed

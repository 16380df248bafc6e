"""A Hugging Face model directory's tokenizer: tokenizer.json, with tokenizer_config.json's special
tokens and chat template. No torch: the bench reads it too."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from goodserve.errors import ModelLoadError
from goodserve.model.spec import ModelSpec
from goodserve.model.tokenizer import Tokenizer


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"cannot read {path}: it holds a JSON {type(data).__name__}, not an object")
    return data


def hf_tokenizer(path: Path, spec: ModelSpec | None) -> Tokenizer | None:
    """None when the directory has no tokenizer.json (then prompts must be token ids).

    spec (when the weights are known) contributes the model's own EOS and BOS ids."""
    if not (path / "tokenizer.json").is_file():
        return None
    config = read_json(path / "tokenizer_config.json")
    backend = HFTokenizer.from_file(str(path / "tokenizer.json"))
    token_id = lambda key: _special_token_id(backend, config.get(key))  # noqa: E731
    eos_id, bos_id = token_id("eos_token"), token_id("bos_token")
    model_eos = spec.eos_token_ids if spec else ()
    eos_ids = list(dict.fromkeys([*model_eos, *([eos_id] if eos_id is not None else [])]))
    return Tokenizer(
        backend,
        bos_token_id=bos_id if bos_id is not None or spec is None else spec.bos_token_id,
        eos_token_ids=eos_ids,
        chat_template=_chat_template(path, config),
        add_bos_token=bool(config.get("add_bos_token", False)),
    )


def _special_token_id(backend: HFTokenizer, token: str | dict | None) -> int | None:
    if isinstance(token, dict):  # serialized AddedToken
        token = token.get("content")
    return backend.token_to_id(token) if token else None


def _chat_template(path: Path, config: dict[str, Any]) -> str | None:
    # transformers >= 4.43 saves the template beside the config as chat_template.jinja.
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t["name"]: t["template"] for t in template}
        return named.get("default") or next(iter(named.values()), None)
    return template

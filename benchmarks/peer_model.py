"""The model both engines serve beside each other: dummy llama-3.1-8b, and the tokenizer they share.

vLLM reads a dummy model's shape from a config.json (load_format "dummy"); goodserve has the same
shape as its preset dummy:llama-3.1-8b.

The tokenizer is synthetic: token i is the word "t<i>", split on whitespace, one vocabulary entry
per id of the model's vocabulary. Why not the embedded SmolLM2 tokenizer that goodserve lends its
large dummy models: its 49,152 ids cover only 38% of llama-3.1's 128,256, and random weights emit
ids from the whole vocabulary, so most generated tokens would decode to no text. A streaming client
times a token by the text it brings (`goodserve bench`: TTFT is the first chunk with text, as in
`vllm bench serve`), so those tokens would stretch TTFT to the first in-vocabulary token, differently
for each engine's random weights. Here every id decodes to text, text re-encodes to the same ids
(prompt lengths are exact on both servers), and both servers read the same files.
"""

from __future__ import annotations

import json
import os
import tempfile

# Llama-3.1-8B's shape, for vLLM's dummy loader (goodserve has it as the preset dummy:llama-3.1-8b).
LLAMA_31_8B_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "max_position_embeddings": 131072, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
    "hidden_act": "silu", "torch_dtype": "bfloat16", "attention_bias": False, "mlp_bias": False,
}
GOODSERVE_MODEL = "dummy:llama-3.1-8b"
# What vLLM is given beside the model directory (offline and served): the rest at its defaults.
VLLM_ENGINE_ARGS = {"load_format": "dummy", "dtype": "bfloat16"}


def write_synthetic_tokenizer(path: str, vocab_size: int, bos_id: int | None, eos_id: int | None) -> str:
    """tokenizer.json + tokenizer_config.json in `path`, read alike by transformers (vLLM) and goodserve."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    backend = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    os.makedirs(path, exist_ok=True)
    backend.save(os.path.join(path, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False, "model_max_length": 1 << 20}
    config.update({"bos_token": f"t{bos_id}"} if bos_id is not None else {})
    config.update({"eos_token": f"t{eos_id}"} if eos_id is not None else {})
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    return path


def preset_of(model: str):
    from goodserve.model.presets import get_preset

    return get_preset(model.removeprefix("dummy:"))


def tokenizer_for(model: str, path: str) -> str:
    """The synthetic tokenizer of `model` (a goodserve dummy preset) written to `path`."""
    spec = preset_of(model)
    return write_synthetic_tokenizer(path, spec.vocab_size, spec.bos_token_id,
                                     spec.eos_token_ids[-1] if spec.eos_token_ids else None)


def vllm_model_dir() -> str:
    """A directory vLLM loads dummy llama-3.1-8b from: its config.json and the synthetic tokenizer."""
    path = tempfile.mkdtemp(prefix="vllm-dummy-")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(LLAMA_31_8B_CONFIG, f)
    return tokenizer_for(GOODSERVE_MODEL, path)

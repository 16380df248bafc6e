"""`serve --generation-config auto` (vLLM's default): a request's unset sampling knobs take the values
the model's generation_config.json recommends. Read from a tiny Hugging Face directory, applied by
the request schemas, and end to end through a real server (the reference: the same engine's greedy
tokens, which a generation config of temperature 0 makes the default)."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from goodserve import LLM, SamplingParams
from goodserve.errors import ModelLoadError
from goodserve.model.loader import load_spec
from goodserve.model.spec import SamplingDefaults
from goodserve.model.tokenizer_loader import embedded_tokenizer
from goodserve.server.app import ServerConfig, sampling_defaults
from goodserve.server.protocol import ChatCompletionRequest, CompletionRequest
from helpers import HTTP_TIMEOUT_S, InProcessServer
from test_loaders import TINY_CONFIGS, save_tiny_hf_model

RECOMMENDED = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "do_sample": True, "eos_token_id": 2}


def tiny_model_dir(path: Path, generation_config: dict) -> Path:
    save_tiny_hf_model(TINY_CONFIGS["llama-gqa-untied"](), path)
    embedded_tokenizer().backend.save(str(path / "tokenizer.json"))  # its ids past the tiny vocabulary go unused
    (path / "generation_config.json").write_text(json.dumps(generation_config))
    return path


def test_the_sampling_fields_of_generation_config_are_read(tmp_path: Path):
    spec = load_spec(str(tiny_model_dir(tmp_path, {**RECOMMENDED, "repetition_penalty": 1})))
    assert spec.sampling_defaults == SamplingDefaults(temperature=0.6, top_p=0.9, top_k=20, repetition_penalty=1.0)
    assert spec.eos_token_ids == (2,)
    with pytest.raises(ModelLoadError, match="generation_config.json"):
        SamplingDefaults.from_generation_config({"temperature": "warm"})


def test_a_request_keeps_what_it_sets_and_takes_the_models_defaults_for_the_rest():
    defaults = SamplingDefaults(temperature=0.6, top_p=0.9, top_k=20)
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], top_p=0.5, min_p=0.1)
    params = chat.sampling_params(defaults)
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.6, 0.5, 20, 0.1)
    # null is no value: the model's; an explicit value equal to the API default is the request's own
    params = CompletionRequest(prompt="hi", temperature=None, top_k=-1).sampling_params(defaults)
    assert (params.temperature, params.top_p, params.top_k) == (0.6, 0.9, -1)
    params = CompletionRequest(prompt="hi").sampling_params()  # no defaults: the API's
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (1.0, 1.0, -1, 1.0)


class _Engine:
    def __init__(self, defaults: SamplingDefaults) -> None:
        self.spec = type("Spec", (), {"sampling_defaults": defaults})()


def test_generation_config_none_ignores_them_and_a_bad_value_stops_the_start():
    recommended = SamplingDefaults(temperature=0.6)
    assert sampling_defaults(_Engine(recommended), ServerConfig()) == recommended
    assert sampling_defaults(_Engine(recommended), ServerConfig(generation_config="none")) == SamplingDefaults()
    with pytest.raises(ModelLoadError, match="temperature.*--generation-config none"):
        sampling_defaults(_Engine(SamplingDefaults(temperature=-1.0)), ServerConfig())


@pytest.mark.slow  # a server of its own; the fast tier checks how the defaults are read and merged
def test_a_server_samples_with_the_models_recommended_temperature(tmp_path: Path):
    model = tiny_model_dir(tmp_path, {"temperature": 0.0, "eos_token_id": 2})  # recommended: greedy
    server = InProcessServer(["--model", str(model), "--max-model-len", "128"])
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=HTTP_TIMEOUT_S)
        prompt = [5, 17, 42, 99, 7]
        greedy = LLM(str(model), max_model_len=128).generate(
            {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
        unset = client.completions.create(model=str(model), prompt=prompt, max_tokens=12,
                                          extra_body={"ignore_eos": True})
        assert unset.choices[0].text == greedy.outputs[0].text and unset.usage.completion_tokens == 12
        sampled = [client.completions.create(model=str(model), prompt=prompt, max_tokens=12, temperature=1.0,
                                             seed=seed, extra_body={"ignore_eos": True}).choices[0].text
                   for seed in range(3)]
        assert any(text != greedy.outputs[0].text for text in sampled)  # the request's own temperature
        assert "generation_config.json values: temperature=0" in server.log()
    finally:
        server.stop()

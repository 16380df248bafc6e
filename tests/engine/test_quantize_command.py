"""`goodserve quantize` writes a checkpoint the engine serves exactly as if it quantized at load."""

from goodserve import LLM, SamplingParams
from goodserve.cli import main
from helpers import loaded_model


def test_quantize_then_serve_the_checkpoint(tmp_path):
    path = tmp_path / "tiny-int4.safetensors"
    assert main(["quantize", "--model", "dummy:tiny", "--quantization", "int4", "--group-size", "32",
                 "--output", str(path)]) == 0
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = {"prompt_token_ids": [5, 9, 13, 2]}
    at_load = LLM("dummy:tiny", quantization="int4", quantization_group_size=32, num_kv_blocks=16)
    from_file = LLM("dummy:tiny", quantized_checkpoint=str(path), num_kv_blocks=16)
    unquantized = LLM("dummy:tiny", num_kv_blocks=16)
    expected = at_load.generate(prompt, params)[0].outputs[0].token_ids
    assert from_file.generate(prompt, params)[0].outputs[0].token_ids == expected
    assert type(loaded_model(from_file).model.layers[0].mlp.down_proj).__name__ == "Int4Linear"
    assert type(loaded_model(unquantized).model.layers[0].mlp.down_proj).__name__ == "PackedCpuLinear"


def test_quantize_rejects_a_group_size_that_does_not_divide(tmp_path, capsys):
    code = main(["quantize", "--model", "dummy:tiny", "--quantization", "int4", "--group-size", "48",
                 "--output", str(tmp_path / "x.safetensors")])
    assert code == 2 and "group" in capsys.readouterr().err


def test_quantize_refuses_an_output_folder_that_does_not_exist(tmp_path, capsys):
    code = main(["quantize", "--model", "dummy:tiny", "--quantization", "int8",
                 "--output", str(tmp_path / "missing" / "x.safetensors")])
    assert code == 2 and "folder does not exist" in capsys.readouterr().err


def test_quantize_refuses_a_mixture_of_experts(tmp_path, capsys):
    code = main(["quantize", "--model", "dummy:tiny-moe", "--quantization", "int8",
                 "--output", str(tmp_path / "x.safetensors")])
    assert code == 2 and "mixture of experts" in capsys.readouterr().err
    assert not (tmp_path / "x.safetensors").exists()

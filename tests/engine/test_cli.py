"""The command line: `goodserve generate` streams what LLM.generate returns; user errors are messages."""

import pytest

from goodserve import SamplingParams
from goodserve.cli import main


@pytest.mark.slow  # the fast tier checks the same output in test_cli_newcomer.py, beside the summary line
def test_generate_prints_the_greedy_completion(embedded_llm, capsys):
    expected = embedded_llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=12))
    assert main(["generate", "--prompt", "The capital of France is", "--max-tokens", "12",
                 "--cpu-kv-cache-bytes", str(64 << 20)]) == 0
    assert capsys.readouterr().out == expected[0].outputs[0].text + "\n"


def test_user_errors_are_one_line_messages(capsys):
    assert main(["generate", "--model", "dummy:tiny", "--prompt", "hello"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("goodserve: error:") and "token ids" in err and "Traceback" not in err
    assert main(["generate", "--model", "/no/such/model.gguf", "--prompt", "hi"]) == 2
    assert "/no/such/model.gguf: no such file or directory" in capsys.readouterr().err
    assert main([]) == 2  # no subcommand: the help, not a crash

"""Grammar-constrained requests on CUDA: masks filled on the host while a pipelined step's forward
runs (async scheduling + CUDA graphs), pinned copies, the mask applied on the device. References:
`json` and `re` (every output follows its grammar) and the engine's own step counters."""

from __future__ import annotations

import json
import re

from gate_checks import build

from goodserve import SamplingParams, StructuredOutputsParams
from goodserve.model_names import EMBEDDED_MODEL

DATE = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]"
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"]}


def test_grammar_requests_pipeline_and_hold(device, cuda_only, record_property):
    llm = build(EMBEDDED_MODEL, device, dtype="float32")
    prompts = ["A person as JSON:", "Today's date:", "Hello, how are you?", "Born on", "Another person:"] * 4
    grammars = [StructuredOutputsParams(json=PERSON), StructuredOutputsParams(regex=DATE), None,
                StructuredOutputsParams(regex=DATE), StructuredOutputsParams(json=PERSON)] * 4
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=48, structured_outputs=g)
              for i, g in enumerate(grammars)]
    stats = llm.engine.stats()
    outputs = llm.generate(prompts, params)
    pipelined = llm.engine.stats().num_pipelined_steps - stats.num_pipelined_steps
    record_property("pipelined_steps", pipelined)
    assert pipelined > 0  # the grammar rows ran ahead with the rest
    for grammar, out in zip(grammars, outputs):
        text = out.outputs[0].text
        if grammar is None:
            continue
        assert out.outputs[0].finish_reason == "stop", text
        if grammar.regex:
            assert re.fullmatch(DATE, text), text
        else:
            assert set(json.loads(text)) == {"name", "age"}, text

"""Sampling on CUDA. Building a step's sampling tensors never waits for the device: with async
scheduling the runner builds them right after launching step N+1's forward, before step N's tokens are
recorded, and a synchronizing call there (a CUDA copy from pageable memory is one) would make the host
wait for that forward instead of working beside it. CUDA's sync debug mode turns every synchronizing
call into an error. And the sampled tokens' logprobs match a rescoring."""

from __future__ import annotations

import warnings

import pytest
import torch
from gate_checks import MODES, build, engine_scores, run

from goodserve.engine.worker.model_inputs import RequestState
from goodserve.engine.worker.sampling_inputs import SamplingRow, build_sampling_batch
from goodserve.model.tokenizer_loader import embedded_tokenizer
from goodserve.model_names import EMBEDDED_MODEL
from goodserve.ops.kernel_choice import TORCH_KERNELS
from goodserve.ops.sampler import apply_penalties, sample
from goodserve.sampling_params import SamplingParams

VOCAB = 1000
EOS = 2


def rows_on(device: torch.device) -> list[SamplingRow]:
    """Every setting that puts a tensor on the device: temperature and top-k/p/min-p, penalties,
    logit_bias, stop tokens banned before min_tokens, a seed; and a greedy row among them."""
    settings = [
        (SamplingParams(temperature=0.8, top_p=0.9, top_k=50, min_p=0.05), [5, 6, 7], [8]),
        (SamplingParams(temperature=1.0, repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.3),
         [9, 10], [11, 11, 12]),
        (SamplingParams(temperature=0.7, logit_bias={13: 5.0, 14: -100.0}, seed=3), [15], []),
        (SamplingParams(temperature=0.0, min_tokens=4, stop_token_ids=[16]), [17, 18], [19]),
    ]
    found = []
    for i, (params, prompt, output) in enumerate(settings):
        generator = torch.Generator(device).manual_seed(params.seed) if params.seed is not None else None
        found.append(SamplingRow(RequestState(f"s{i}", params, prompt, False, generator), len(output), output))
    return found


def test_sampling_tensors_never_synchronize(cuda_only, record_property):
    device = torch.device("cuda")
    logits = torch.randn(4, VOCAB, device=device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError):  # the detector works here: reading a value back synchronizes
            logits[0, 0].item()
        try:  # what the builder did before (recorded, not asserted: it is torch's business)
            torch.tensor([1.0, 2.0], device=device)
            record_property("pageable_copy_synchronizes", False)
        except RuntimeError:
            record_property("pageable_copy_synchronizes", True)
        batch = build_sampling_batch(rows_on(device), VOCAB, device, [EOS])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    # The sampler's own ops (torch's) recorded, not asserted: a synchronizing one would be the next fix.
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            penalized = apply_penalties(logits, batch)
            sampled = sample(logits, batch, TORCH_KERNELS)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    record_property("sampler_synchronizing_calls", [str(w.message)[:200] for w in caught])
    # The same settings built on the CPU penalize the same way, and the banned stop tokens stay out.
    reference = apply_penalties(logits.cpu(), build_sampling_batch(rows_on(torch.device("cpu")), VOCAB,
                                                                    torch.device("cpu"), [EOS]))
    torch.testing.assert_close(penalized.cpu(), reference)
    assert sampled.token_ids[3].item() not in (EOS, 16)


def test_sampled_logprobs_match_a_rescoring(device, cuda_only):
    """The sampled tokens' logprobs on CUDA (the prompt logprobs are checked everywhere else): two
    requests at temperature 0.8 with top-5 logprobs get, at every position, what scoring the finished
    sequences again gives (float32)."""
    llm = build(EMBEDDED_MODEL, device, dtype="float32", **MODES["graphs+async"])
    tokenizer = embedded_tokenizer()
    prompts = [tokenizer.encode("The capital of France is"), tokenizer.encode("Once upon a time, there")]
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=16, ignore_eos=True, logprobs=5)
    outputs = run(llm, prompts, params)
    sequences = [prompt + out.outputs[0].token_ids for prompt, out in zip(prompts, outputs)]
    for prompt, out, scores in zip(prompts, outputs, engine_scores(llm, sequences)):
        completion = out.outputs[0]
        assert len(completion.logprobs) == len(completion.token_ids) == params.max_tokens
        for position, entry in enumerate(completion.logprobs):
            reference = scores[len(prompt) - 1 + position]  # scores start at the prompt's second token
            assert len(entry) >= 5 and set(entry) <= set(reference)  # the sampled token and the top 5
            for token, logprob in entry.items():
                assert abs(logprob.logprob - reference[token]) < 1e-2, (position, token)

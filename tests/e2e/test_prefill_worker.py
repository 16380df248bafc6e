"""The prefill worker (engine/disagg/prefill_worker.py) in its own process, this test as the decode side:
the worker's engine prefills the next prompt while an earlier prompt's KV waits for the decode side
to take it, and both then decode to one engine's greedy tokens. The embedded model, float32, gloo."""

from __future__ import annotations

import math
import multiprocessing

import torch.distributed as dist

from goodserve.config import EngineConfig
from goodserve.engine.frontend.engine import Engine
from goodserve.engine.disagg.kv_transfer import receive_prefilled
from goodserve.engine.disagg.prefill_worker import DECODE_RANK, PREFILL_RANK, prefill_worker_main
from goodserve.sampling_params import SamplingParams

CONFIG = EngineConfig(dtype="float32", device="cpu", num_kv_blocks=32, max_model_len=256)
PROMPTS = {"first": "The printing press spread across Europe within fifty years, and with it",
           "second": "A lighthouse keeper writes in the log every night: the weather, the ships, and"}
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def next_message(conn, kind: str, timeout: float = 120.0):
    """The next message of this kind (stats in between are skipped unless asked for)."""
    while conn.poll(timeout):
        message = conn.recv()
        if message[0] == kind:
            return message
    raise AssertionError(f"no {kind!r} message from the prefill worker in {timeout} s")


def test_the_next_prompt_is_prefilled_while_an_exchange_waits(tmp_path):
    init_method = f"file://{tmp_path / 'init'}"
    context = multiprocessing.get_context("spawn")
    conn, child = context.Pipe()
    worker = context.Process(target=prefill_worker_main, args=(CONFIG, child, init_method), daemon=True)
    worker.start()
    dist.init_process_group("gloo", init_method=init_method, rank=DECODE_RANK, world_size=2)
    try:
        engine = Engine(CONFIG)
        ids = {name: engine.inputs.tokenize_prompt(prompt)[1] for name, prompt in PROMPTS.items()}
        next_message(conn, "started")
        conn.send(("add", "first", ids["first"]))
        assert next_message(conn, "prefilled")[1] == "first"
        # The first prompt's exchange now waits for this side; the worker takes the second meanwhile.
        conn.send(("add", "second", ids["second"]))
        first_blocks = math.ceil(len(ids["first"]) / CONFIG.block_size)
        while True:
            stats = next_message(conn, "stats")[1]
            if stats.num_running == 0 and stats.num_waiting == 0 and stats.num_used_kv_blocks > first_blocks:
                break  # both prefilled, both held
        assert receive_prefilled(engine, "first", GREEDY, PREFILL_RANK)
        assert next_message(conn, "prefilled")[1] == "second"
        assert receive_prefilled(engine, "second", GREEDY, PREFILL_RANK)
        decoded = {}
        while engine.has_unfinished():
            decoded.update({o.request_id: o.outputs[0].token_ids for o in engine.step()})
        for name, prompt in PROMPTS.items():
            engine.add_request(f"{name}-here", prompt, GREEDY)
        while engine.has_unfinished():
            decoded.update({o.request_id: o.outputs[0].token_ids for o in engine.step()})
        assert decoded["first"] == decoded["first-here"] and decoded["second"] == decoded["second-here"]
        assert engine.kv.num_used_blocks == 0
        while (stats := next_message(conn, "stats")[1]).num_used_kv_blocks:
            pass  # the worker gave its held blocks back once each exchange ended
    finally:
        conn.send(("stop",))
        worker.join(120)
        dist.destroy_process_group()
    assert worker.exitcode == 0

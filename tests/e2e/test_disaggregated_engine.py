"""The disaggregated server's engine in this process (its prefill worker a child process, gloo, the
embedded model in float32): a KV exchange runs on a thread of its own, so while one is held in the
middle of its blocks the engine thread serves other requests to the end, and the held request, once
let go, decodes to one engine's greedy tokens; no block is left in use."""

from __future__ import annotations

import asyncio
import threading

from goodserve import LLM, SamplingParams
from goodserve.config import EngineConfig
from goodserve.engine.disagg import kv_transfer
from goodserve.engine.disagg.disagg_layout import parse_disaggregate
from goodserve.server.disaggregated import DisaggregatedEngine

CONFIG = EngineConfig(model="smollm2-135m", dtype="float32", device="cpu", max_model_len=512, num_kv_blocks=64)
MOVED = "The printing press spread across Europe within fifty years, and with it came"
LOCAL = "A lighthouse keeper writes in the log every night:"
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


async def last_output(stream):
    output = None
    async for output in stream:
        pass
    return output


def test_a_transfer_in_flight_never_stalls_the_engine_thread(monkeypatch):
    entered, release = threading.Event(), threading.Event()
    unpack = kv_transfer.unpack_blocks

    def held_unpack(*args) -> None:  # on the receiving thread: the exchange stops mid-blocks
        entered.set()
        assert release.wait(120)
        unpack(*args)

    monkeypatch.setattr(kv_transfer, "unpack_blocks", held_unpack)
    expected = LLM("smollm2-135m", dtype="float32").generate(
        [MOVED, LOCAL], [GREEDY, SamplingParams(n=2, max_tokens=8, temperature=0.0, ignore_eos=True)])
    engine = DisaggregatedEngine(CONFIG, parse_disaggregate("prefill:0,decode:1"))

    async def run():
        await engine.start()
        moved = asyncio.create_task(last_output(engine.generate("moved", MOVED, GREEDY)))
        assert await asyncio.to_thread(entered.wait, 120)
        # n = 2: prefilled and decoded here, on the engine thread, while the transfer is held
        local = await last_output(engine.generate(
            "local", LOCAL, SamplingParams(n=2, max_tokens=8, temperature=0.0, ignore_eos=True)))
        held = not moved.done()
        release.set()
        return await moved, local, held

    try:
        moved, local, held = asyncio.run(run())
    finally:
        release.set()
        asyncio.run(engine.shutdown(drain_timeout_s=5))
    assert held, "the engine thread served a request to the end while the transfer was held"
    assert moved.outputs[0].token_ids == expected[0].outputs[0].token_ids
    assert [c.token_ids for c in local.outputs] == [c.token_ids for c in expected[1].outputs]
    assert engine.engine.kv.num_used_blocks == 0

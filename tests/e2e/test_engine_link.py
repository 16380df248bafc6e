"""The link to the engine's process (engine/frontend/engine_process.py): a request that cannot cross it (a value
pickle cannot take) fails alone and the engine keeps serving; a link that breaks says so on /health
(503) and fails its requests at once instead of leaving them to hang. On dummy:tiny."""

from __future__ import annotations

import asyncio

import httpx2
import pytest

from goodserve.config import EngineConfig
from goodserve.engine.frontend.engine_process import EngineProcess
from goodserve.errors import EngineDeadError, EngineStepError
from goodserve.sampling_params import SamplingParams
from goodserve.server.app import ServerConfig, build_app

CONFIG = EngineConfig(model="dummy:tiny", num_kv_blocks=64)
WAIT_S = 120  # generous: a request that is never answered fails here instead of hanging the suite


def unpicklable_params() -> SamplingParams:
    """Params holding a list nested past pickle's recursion limit, as a schema nested a few hundred
    levels once did."""
    deep: list = []
    inner = deep
    for _ in range(5000):
        inner.append([])
        inner = inner[0]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    params.stop_token_ids = deep
    return params


async def collect(engine, request_id: str, params: SamplingParams) -> list:
    async def run():
        return [out async for out in engine.generate(request_id, [1, 2, 3], params)]
    return await asyncio.wait_for(run(), WAIT_S)


async def health(engine, tmp_path) -> int:
    app = build_app(engine, ServerConfig(data_dir=str(tmp_path)))
    async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://goodserve") as client:
        return (await client.get("/health")).status_code


@pytest.fixture
def engine():
    engine = EngineProcess(CONFIG)
    asyncio.run(engine.start())
    yield engine
    asyncio.run(engine.shutdown(5.0))


def test_a_request_that_cannot_be_sent_fails_alone_and_the_engine_keeps_serving(engine, tmp_path):
    async def bad_between_good():
        good = SamplingParams(max_tokens=4, ignore_eos=True)
        return await asyncio.gather(collect(engine, "before", good), collect(engine, "bad", unpicklable_params()),
                                    collect(engine, "after", good), return_exceptions=True)

    before, bad, after = asyncio.run(bad_between_good())
    assert isinstance(bad, EngineStepError) and "could not be sent" in str(bad)
    assert before[-1].finished and after[-1].finished
    later = asyncio.run(collect(engine, "later", SamplingParams(max_tokens=3, ignore_eos=True)))
    assert len(later[-1].outputs[0].token_ids) == 3
    assert engine.dead is None and asyncio.run(health(engine, tmp_path)) == 200


def test_a_link_that_breaks_is_unhealthy_and_fails_requests_at_once(engine, tmp_path, monkeypatch):
    def broken(items):
        raise RuntimeError("a bug in the link")

    monkeypatch.setattr(engine, "_deliver", broken)  # how the link answers a request it could not send
    with pytest.raises(EngineDeadError, match="link to the engine process broke"):
        asyncio.run(collect(engine, "breaks-it", unpicklable_params()))
    assert asyncio.run(health(engine, tmp_path)) == 503
    with pytest.raises(EngineDeadError):
        asyncio.run(collect(engine, "later", SamplingParams(max_tokens=2)))

"""Prefill on one engine, decode on another: two CPU processes (gloo), the embedded model in float32.
The decoding engine's greedy tokens equal one engine's doing both; an abort on either side, or a
refusal for lack of room, leaves no block held on either side."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from goodserve.config import EngineConfig
from goodserve.engine.frontend.engine import Engine
from goodserve.engine.disagg.kv_transfer import receive_prefilled, send_prefilled
from goodserve.sampling_params import SamplingParams

PROMPT = ("The history of the printing press begins in the fifteenth century, when a goldsmith in Mainz "
          "combined movable metal type, oil-based ink and a wooden screw press; within fifty years")
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
FIRST_TOKEN = SamplingParams(max_tokens=1, temperature=0.0)
SENDER, RECEIVER = 0, 1


def run(engine: Engine) -> dict:
    """Step until done; each request's last output."""
    outputs = {}
    while engine.has_unfinished():
        outputs.update({o.request_id: o for o in engine.step()})
    return outputs


def prefill_and_send(engine: Engine, request_id: str, prompt: str, abort: bool = False) -> tuple[bool, list[int]]:
    engine.add_prefill_request(request_id, prompt, FIRST_TOKEN)
    if abort:
        engine.abort_request(request_id)
        prompt_ids = engine.inputs.tokenize_prompt(prompt)[1]
    else:
        done = run(engine)[request_id]
        prompt_ids = done.prompt_token_ids
        first = done.outputs[0].token_ids
    sent = send_prefilled(engine, request_id, prompt_ids, RECEIVER)
    return sent, ([] if abort else first)


def sender(engine: Engine) -> dict:
    found = {"reference": run_reference(engine)}
    found["sent"], found["first_token"] = prefill_and_send(engine, "moved", PROMPT)
    found["used_after_send"] = engine.kv.num_used_blocks
    found["aborted_sent"], _ = prefill_and_send(engine, "aborted-here", PROMPT + " the abort", abort=True)
    found["used_after_abort"] = engine.kv.num_used_blocks
    found["sent_then_aborted"], _ = prefill_and_send(engine, "aborted-there", PROMPT + " then")
    found["refused_sent"], _ = prefill_and_send(engine, "refused", PROMPT * 3)
    found["used_at_end"] = engine.kv.num_used_blocks
    return found


def run_reference(engine: Engine) -> list[int]:
    engine.add_request("reference", PROMPT, GREEDY)
    return run(engine)["reference"].outputs[0].token_ids


def receiver(engine: Engine) -> dict:
    # Its pool is all zeros until the transfer: decoding without the sent K/V could not match.
    found = {"taken": receive_prefilled(engine, "moved", GREEDY, SENDER)}
    found["cached"] = engine.scheduler.seqs["moved#0"].num_computed_tokens
    found["decoded"] = run(engine)["moved"].outputs[0].token_ids
    found["aborted_taken"] = receive_prefilled(engine, "aborted-here", GREEDY, SENDER)
    found["used_after_abort"] = engine.kv.num_used_blocks
    found["then_taken"] = receive_prefilled(engine, "aborted-there", GREEDY, SENDER)
    engine.step()
    engine.abort_request("aborted-there")
    found["used_after_own_abort"] = engine.kv.num_used_blocks
    # A long local request fills the pool: the next transfer finds no room.
    engine.add_request("local", [7] * 230, SamplingParams(max_tokens=8))
    engine.step()
    found["refused_taken"] = receive_prefilled(engine, "refused", GREEDY, SENDER)
    engine.abort_request("local")
    found["used_at_end"] = engine.kv.num_used_blocks
    return found


def rank_main(rank: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        engine = Engine(EngineConfig(dtype="float32", device="cpu", num_kv_blocks=16, max_model_len=256))
        found = sender(engine) if rank == SENDER else receiver(engine)
        Path(out_dir, f"{rank}.json").write_text(json.dumps(found))
    finally:
        dist.destroy_process_group()


def test_prefill_here_decode_there_matches_one_engine_and_frees_both_sides(tmp_path):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(rank_main, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    sent, got = (json.loads((tmp_path / f"{rank}.json").read_text()) for rank in (SENDER, RECEIVER))
    assert sent["sent"] and got["taken"]
    prompt_len = got["cached"] + 1
    assert prompt_len > 2 * 16  # several blocks crossed
    assert got["decoded"] == sent["reference"]  # greedy, float32: exactly the one-engine tokens
    assert got["decoded"][:1] == sent["first_token"]
    assert sent["used_after_send"] == 0
    # The sender's request aborted before its prefill: nothing crosses, nothing stays held.
    assert not sent["aborted_sent"] and not got["aborted_taken"]
    assert sent["used_after_abort"] == 0 and got["used_after_abort"] == 0
    # Sent, then aborted by the receiver mid-decode: its blocks are freed with it.
    assert sent["sent_then_aborted"] and got["then_taken"] and got["used_after_own_abort"] == 0
    # No room on the receiver: refused, and the sender's blocks are released all the same.
    assert not sent["refused_sent"] and not got["refused_taken"]
    assert sent["used_at_end"] == 0 and got["used_at_end"] == 0


def random_layers(num_blocks: int, dtype: torch.dtype, seed: int) -> list:
    from goodserve.ops.attention import LayerKVCache

    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, 4, 2, 8)  # blocks, block size, KV heads, head dim

    def pool() -> torch.Tensor:
        return torch.randn(shape, generator=g).mul(20).to(dtype)

    scales = dtype == torch.int8
    return [LayerKVCache(pool(), pool(), torch.rand(shape[:3], generator=g) if scales else None,
                         torch.rand(shape[:3], generator=g) if scales else None) for _ in range(3)]


def test_blocks_cross_in_groups_byte_for_byte_for_every_kv_dtype(monkeypatch):
    """More blocks than a message holds, at scattered ids on both sides, in every KV dtype the engine
    keeps (int8 with its scales, float8): each block lands whole at its new id, and nothing else moves."""
    from goodserve.engine.disagg import kv_transfer

    monkeypatch.setattr(kv_transfer, "BLOCKS_PER_MESSAGE", 3)
    for dtype in (torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn):
        sender, receiver = random_layers(12, dtype, 0), random_layers(12, dtype, 1)
        before = [[t.clone() for t in (layer.k, layer.v, layer.k_scale, layer.v_scale) if t is not None]
                  for layer in receiver]
        src_ids, dst_ids = [5, 0, 9, 3, 11, 7, 2], [1, 10, 4, 6, 0, 8, 3]
        src_pools, dst_pools = kv_transfer._pools(sender), kv_transfer._pools(receiver)
        groups = list(zip(kv_transfer._groups(src_ids, torch.device("cpu")),
                          kv_transfer._groups(dst_ids, torch.device("cpu"))))
        assert len(groups) == 3
        for src, dst in groups:
            data = kv_transfer.pack_blocks(src_pools, src)
            assert data.numel() == len(src) * kv_transfer._bytes_per_block(src_pools)
            kv_transfer.unpack_blocks(dst_pools, dst, data)
        for layer_from, layer_to, kept in zip(sender, receiver, before):
            pools = [(a, b) for a, b in ((layer_from.k, layer_to.k), (layer_from.v, layer_to.v),
                                         (layer_from.k_scale, layer_to.k_scale),
                                         (layer_from.v_scale, layer_to.v_scale)) if a is not None]
            for (a, b), old in zip(pools, kept):
                for s, d in zip(src_ids, dst_ids):
                    assert torch.equal(a[s].view(torch.uint8), b[d].view(torch.uint8)), dtype
                untouched = [i for i in range(12) if i not in dst_ids]
                assert torch.equal(b[untouched].view(torch.uint8), old[untouched].view(torch.uint8)), dtype

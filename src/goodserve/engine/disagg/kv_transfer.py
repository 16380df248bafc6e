"""A prefilled sequence's KV blocks from one engine to another over torch.distributed point-to-point
(gloo between CPU processes, NCCL between GPUs): the primitive of prefill / decode disaggregation.

The sender's engine ran the request with add_prefill_request (its blocks held past its finish); the
receiver's engine reserves blocks when the transfer arrives, they are filled, then it admits the
request and decodes it (Engine.reserve_decode_request / admit_decode_request). The exchange, on one
process group:

    sender -> receiver   header [status, prompt tokens, blocks, bytes per block, block size]
                         status ABORTED (the request ended before its prefill did): nothing follows
    sender -> receiver   the prompt's token ids
    receiver -> sender   ACCEPTED, or REFUSED (no room, or a request the receiver cannot take)
    sender -> receiver   the blocks, BLOCKS_PER_MESSAGE to a message: every layer's K and V (and int8
                         scales) of those blocks as raw bytes, so any KV dtype crosses unchanged

The sender releases its blocks once they are sent, refused or aborted; a refused or failed import
frees the receiver's; afterwards the receiver's blocks are its request's like any other's (an abort
frees them). Every block of the prompt but the last token's is sent: the receiver computes that
token itself, which samples the first output token as a prefix-cache hit would.

Why groups of blocks: one message a block (a 2 MB block of Llama-3.1-8B in bfloat16) cost a gather
and a send on the sender and 64 copies into the pool on the receiver for every 16 tokens, and the
receiver did it on its engine thread, between decode steps (a server now receives on a thread of its
own, server/disaggregated.py): on two H100s, 2k-token prompts at 2 req/s waited a median 636 ms for
their first token and the decodes beside them saw inter-token gaps of up to 528 ms
(benchmarks/BENCHMARKS.md). Gathered per layer part with one index_select, a group
is one message and one index_copy_ per part on arrival; a group, not the whole prompt, so the
receive buffer stays small beside a pool that fills the GPU.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from goodserve.engine.frontend.engine import Engine
from goodserve.errors import InvalidRequestError
from goodserve.ops.attention import LayerKVCache
from goodserve.sampling_params import SamplingParams

OK, ABORTED = 1, 0
ACCEPTED, REFUSED = 1, 0
BLOCKS_PER_MESSAGE = 32  # 64 MB a message at Llama-3.1-8B's 2 MB bfloat16 blocks


def kv_layers(engine: Engine) -> list[LayerKVCache]:
    """The engine's KV pools; they live with its worker, so in this process only (executor 'uni')."""
    worker = getattr(engine.executor, "worker", None)
    if worker is None:
        raise InvalidRequestError("KV transfer needs the engine's worker in its process (executor_backend='uni')")
    return worker.runner.kv_caches


def _pools(layers: list[LayerKVCache]) -> list[torch.Tensor]:
    """Every pool a block has a row in (each layer's K and V, and int8 scales; once each where layers
    of several groups share one: engine/setup/kv_groups.py), as bytes [blocks, -1]: index_select and
    index_copy_ take uint8 where some take no float8."""
    pools = {pool.data_ptr(): pool for layer in layers
             for pool in (layer.k, layer.v, layer.k_scale, layer.v_scale) if pool is not None}
    return [pool.view(pool.shape[0], -1).view(torch.uint8) for pool in pools.values()]


def _bytes_per_block(pools: list[torch.Tensor]) -> int:
    return sum(pool.shape[1] for pool in pools)


def pack_blocks(pools: list[torch.Tensor], block_ids: torch.Tensor) -> torch.Tensor:
    """The blocks' rows of every pool, pool after pool."""
    return torch.cat([pool.index_select(0, block_ids).reshape(-1) for pool in pools])


def unpack_blocks(pools: list[torch.Tensor], block_ids: torch.Tensor, data: torch.Tensor) -> None:
    offset = 0
    for pool in pools:
        size = len(block_ids) * pool.shape[1]
        pool.index_copy_(0, block_ids, data[offset:offset + size].view(len(block_ids), pool.shape[1]))
        offset += size


def _groups(block_ids: list[int], device: torch.device) -> list[torch.Tensor]:
    return [torch.tensor(block_ids[i:i + BLOCKS_PER_MESSAGE], dtype=torch.int64, device=device)
            for i in range(0, len(block_ids), BLOCKS_PER_MESSAGE)]


def _wire_device(layers: list[LayerKVCache], group) -> torch.device:
    return torch.device("cpu") if dist.get_backend(group) == "gloo" else layers[0].k.device


def _send(values: list[int], dst: int, group, device: torch.device) -> None:
    dist.send(torch.tensor(values, dtype=torch.int64, device=device), dst, group)


def _recv(count: int, src: int, group, device: torch.device) -> list[int]:
    buffer = torch.empty(count, dtype=torch.int64, device=device)  # NCCL moves GPU tensors only
    dist.recv(buffer, src, group)
    return buffer.tolist()


def send_prefilled(engine: Engine, request_id: str, prompt_token_ids: list[int], dst: int,
                   group=None) -> bool:
    """After the engine finished request_id (added with add_prefill_request): send its blocks to
    rank dst and release them. True: the receiver took them."""
    try:
        return send_held(kv_layers(engine), engine.held_kv(request_id), engine.config.block_size, prompt_token_ids,
                         dst, group)
    finally:
        engine.release_held(request_id)


def send_held(layers: list[LayerKVCache], held: tuple[list[int], int], block_size: int,
              prompt_token_ids: list[int], dst: int, group=None) -> bool:
    """send_prefilled's exchange without the engine: held is its held_kv(), and the caller releases
    the blocks once this returns (it may run on a thread of its own while the engine steps on: it
    only reads those blocks, which nothing else writes while they are held)."""
    blocks, num_computed = held
    pools = _pools(layers)
    num_groups = 1 + max(layer.group for layer in layers)  # a block of each a block of tokens
    needed = -(-(len(prompt_token_ids) - 1) // block_size) * num_groups
    device = _wire_device(layers, group)
    if num_computed < len(prompt_token_ids) - 1:  # aborted or failed before its prompt was computed
        _send([ABORTED, 0, 0, 0, block_size], dst, group, device)
        return False
    _send([OK, len(prompt_token_ids), needed, _bytes_per_block(pools), block_size], dst, group, device)
    _send(prompt_token_ids, dst, group, device)
    if _recv(1, dst, group, device)[0] != ACCEPTED:
        return False
    for ids in _groups(blocks[:needed], layers[0].k.device):
        dist.send(pack_blocks(pools, ids).to(device), dst, group)
    return True


@dataclass
class Incoming:
    """A prefilled request's header and prompt, received: its blocks wait for a block table here."""

    prompt_token_ids: list[int]
    num_blocks: int
    block_bytes: int
    block_size: int


def receive_header(layers: list[LayerKVCache], src: int, group=None) -> Incoming | None:
    """The exchange's start; None: the sender aborted the request (nothing follows)."""
    device = _wire_device(layers, group)
    status, num_tokens, num_blocks, block_bytes, block_size = _recv(5, src, group, device)
    if status == ABORTED:
        return None
    return Incoming(_recv(num_tokens, src, group, device), num_blocks, block_bytes, block_size)


def refuse(layers: list[LayerKVCache], src: int, group=None) -> None:
    _send([REFUSED], src, group, _wire_device(layers, group))


def receive_blocks(layers: list[LayerKVCache], incoming: Incoming, block_size: int, table: list[int], src: int,
                   group=None) -> None:
    """Accept the blocks into table and put them in place: blocks no step reads or writes until the
    request is admitted, so this may run beside the engine's steps (on CUDA on a stream of its own,
    finished before it returns). Blocks of another shape are refused with InvalidRequestError."""
    pools = _pools(layers)
    if incoming.block_size != block_size or incoming.block_bytes != _bytes_per_block(pools):
        refuse(layers, src, group)
        raise InvalidRequestError(f"the sender's KV blocks ({incoming.block_size} tokens, {incoming.block_bytes} "
                                  f"bytes) are not this engine's (same model, dtype, KV dtype and block size needed)")
    device, pool_device = _wire_device(layers, group), layers[0].k.device
    _send([ACCEPTED], src, group, device)
    stream = torch.cuda.Stream(pool_device) if pool_device.type == "cuda" else None
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        for ids in _groups(table[:incoming.num_blocks], pool_device):
            buffer = torch.empty(len(ids) * incoming.block_bytes, dtype=torch.uint8, device=device)
            dist.recv(buffer, src, group)
            unpack_blocks(pools, ids, buffer.to(pool_device))
    if stream is not None:
        stream.synchronize()


def receive_prefilled(engine: Engine, request_id: str, params: SamplingParams, src: int, group=None,
                      arrival_time: float | None = None) -> bool:
    """Take a prefilled request from rank src into this engine, which then decodes it (step as
    usual), all on the caller's thread. False: the sender aborted it, or this engine refused it (no
    room): nothing is held. arrival_time: when the request reached the sender's side (its TTFT counts
    the prefill). server/disaggregated.py runs the same exchange on a thread of its own instead."""
    layers = kv_layers(engine)
    incoming = receive_header(layers, src, group)
    if incoming is None:
        return False
    try:
        request = engine.reserve_decode_request(request_id, incoming.prompt_token_ids, params, arrival_time)
    except BaseException:  # a request this engine cannot take: the sender waits for an answer
        refuse(layers, src, group)
        raise
    if request is None:
        refuse(layers, src, group)
        return False
    try:
        receive_blocks(layers, incoming, engine.config.block_size, engine.reserved_blocks(request), src, group)
    except BaseException:
        engine.release_decode_request(request)
        raise
    engine.admit_decode_request(request)
    return True

"""A prefilled sequence's KV blocks from one engine to another over torch.distributed point-to-point
(gloo between CPU processes, NCCL between GPUs): the primitive of prefill / decode disaggregation.

The sender's engine ran the request with add_prefill_request (its blocks held past its finish); the
receiver's engine allocates blocks when the transfer arrives and decodes (add_decode_request). The
exchange, on one process group:

    sender -> receiver   header [status, prompt tokens, blocks, bytes per block, block size]
                         status ABORTED (the request ended before its prefill did): nothing follows
    sender -> receiver   the prompt's token ids
    receiver -> sender   ACCEPTED, or REFUSED (no room, or a request the receiver cannot take)
    sender -> receiver   each block, one message per block: every layer's K and V (and int8 scales)
                         as raw bytes, so any KV dtype crosses unchanged

The sender releases its blocks once they are sent, refused or aborted; a refused or failed import
frees the receiver's; afterwards the receiver's blocks are its request's like any other's (an abort
frees them). Every block of the prompt but the last token's is sent: the receiver computes that
token itself, which samples the first output token as a prefix-cache hit would.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from goodserve.engine.engine import Engine
from goodserve.errors import InvalidRequestError
from goodserve.ops.attention import LayerKVCache
from goodserve.sampling_params import SamplingParams

OK, ABORTED = 1, 0
ACCEPTED, REFUSED = 1, 0


def kv_layers(engine: Engine) -> list[LayerKVCache]:
    """The engine's KV pools; they live with its worker, so in this process only (executor 'uni')."""
    worker = getattr(engine.executor, "worker", None)
    if worker is None:
        raise InvalidRequestError("KV transfer needs the engine's worker in its process (executor_backend='uni')")
    return worker.runner.kv_caches


def _block_parts(layer: LayerKVCache, block_id: int) -> list[torch.Tensor]:
    parts = [layer.k[block_id], layer.v[block_id]]
    return parts + [s[block_id] for s in (layer.k_scale, layer.v_scale) if s is not None]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def pack_block(layers: list[LayerKVCache], block_id: int) -> torch.Tensor:
    return torch.cat([_bytes(part) for layer in layers for part in _block_parts(layer, block_id)])


def unpack_block(layers: list[LayerKVCache], block_id: int, data: torch.Tensor) -> None:
    offset = 0
    for layer in layers:
        for part in _block_parts(layer, block_id):
            target = _bytes(part)  # a view: the copy writes into the pool
            target.copy_(data[offset:offset + target.numel()])
            offset += target.numel()


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
    layers, (blocks, num_computed) = kv_layers(engine), engine.held_kv(request_id)
    size = engine.config.block_size
    needed = -(-(len(prompt_token_ids) - 1) // size)
    device = _wire_device(layers, group)
    try:
        if num_computed < len(prompt_token_ids) - 1:  # aborted or failed before its prompt was computed
            _send([ABORTED, 0, 0, 0, size], dst, group, device)
            return False
        block_bytes = pack_block(layers, blocks[0]).numel() if needed else 0
        _send([OK, len(prompt_token_ids), needed, block_bytes, size], dst, group, device)
        _send(prompt_token_ids, dst, group, device)
        if _recv(1, dst, group, device)[0] != ACCEPTED:
            return False
        for block_id in blocks[:needed]:
            dist.send(pack_block(layers, block_id).to(device), dst, group)
        return True
    finally:
        engine.release_held(request_id)


def receive_prefilled(engine: Engine, request_id: str, params: SamplingParams, src: int, group=None,
                      arrival_time: float | None = None) -> bool:
    """Take a prefilled request from rank src into this engine, which then decodes it (step as
    usual). False: the sender aborted it, or this engine refused it (no room): nothing is held.
    arrival_time: when the request reached the sender's side (its TTFT counts the prefill)."""
    layers = kv_layers(engine)
    device = _wire_device(layers, group)
    status, num_tokens, num_blocks, block_bytes, size = _recv(5, src, group, device)
    if status == ABORTED:
        return False
    prompt = _recv(num_tokens, src, group, device)
    answered = False

    def fill(table: list[int]) -> None:
        nonlocal answered
        if size != engine.config.block_size or block_bytes != pack_block(layers, table[0]).numel():
            raise InvalidRequestError(f"the sender's KV blocks ({size} tokens, {block_bytes} bytes) are not this "
                                      f"engine's (same model, dtype, KV dtype and block size needed)")
        _send([ACCEPTED], src, group, device)
        answered = True
        buffer = torch.empty(block_bytes, dtype=torch.uint8, device=device)
        for block_id in table[:num_blocks]:
            dist.recv(buffer, src, group)
            unpack_block(layers, block_id, buffer.to(layers[0].k.device))

    try:
        taken = engine.add_decode_request(request_id, prompt, params, fill, arrival_time) if num_blocks else False
    finally:
        if not answered:
            _send([REFUSED], src, group, device)
    return taken

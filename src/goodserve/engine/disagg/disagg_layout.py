"""`--disaggregate prefill:GPUS,decode:GPUS`: which GPU (CUDA) or process (CPU) does which half.

One prefill and one decode worker for now: each role names one id. On CUDA the ids are GPU indices
among those visible (CUDA_VISIBLE_DEVICES, as nvidia-smi numbers them when unset); on the CPU they only
name the two processes."""

from __future__ import annotations

import os
from dataclasses import dataclass

from goodserve.errors import InvalidRequestError

ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class DisaggLayout:
    prefill: str
    decode: str


def parse_disaggregate(value: str) -> DisaggLayout:
    """'prefill:0,decode:1' -> DisaggLayout('0', '1'); anything else: a message that shows the form."""
    example = "expected prefill:ID,decode:ID, e.g. --disaggregate prefill:0,decode:1"
    ids: dict[str, list[str]] = {}
    role = None
    for part in value.replace(" ", "").split(","):
        if ":" in part:
            role, _, part = part.partition(":")
            if role not in ROLES or role in ids:
                raise InvalidRequestError(f"--disaggregate {value!r}: unknown or repeated role {role!r}; {example}")
            ids[role] = []
        if role is None or not part.isdigit():
            raise InvalidRequestError(f"--disaggregate {value!r}: {part!r} is not a GPU id; {example}")
        ids[role].append(part)
    if sorted(ids) != sorted(ROLES):
        raise InvalidRequestError(f"--disaggregate {value!r}: both roles are needed; {example}")
    if len(ids["prefill"]) != 1 or len(ids["decode"]) != 1:
        raise InvalidRequestError(f"--disaggregate {value!r}: one prefill and one decode worker for now "
                                  f"(one id each); {example}")
    layout = DisaggLayout(ids["prefill"][0], ids["decode"][0])
    if layout.prefill == layout.decode:
        raise InvalidRequestError(f"--disaggregate {value!r}: prefill and decode need different ids; {example}")
    return layout


def cuda_visible(layout: DisaggLayout, device: str) -> tuple[str | None, str | None]:
    """Each side's CUDA_VISIBLE_DEVICES (prefill, decode); None, None on the CPU."""
    if device == "cpu":
        return None, None
    import torch

    count = torch.cuda.device_count()
    if count == 0 and device == "auto":
        return None, None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = visible.split(",") if visible else [str(i) for i in range(count)]
    for gpu_id in (layout.prefill, layout.decode):
        if int(gpu_id) >= len(gpus):
            raise InvalidRequestError(f"--disaggregate names GPU {gpu_id}; {len(gpus)} visible")
    return gpus[int(layout.prefill)], gpus[int(layout.decode)]

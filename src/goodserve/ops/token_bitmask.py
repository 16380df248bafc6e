"""Grammar masks in the sampler: a packed bitmask per constrained row (bit t of word t // 32 set:
token t allowed, as xgrammar and llguidance fill it) sets every other token's logit to -inf.

Only the rows that have a grammar carry a mask row, so a batch mixing constrained and free
requests masks just the former; a batch with no grammar builds nothing at all.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, W] int32 -> [R, vocab_size] bool; tokens past the mask's 32 W are not allowed. An
    arithmetic shift of a negative word keeps bit 31 right."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab_size].bool()
    return F.pad(allowed, (0, vocab_size - allowed.shape[1]))


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """logits [N, V] with the disallowed tokens of rows (all N when None) at -inf; a new tensor."""
    allowed = unpack_bitmask(bitmask, logits.shape[-1])
    if rows is None:
        return logits.masked_fill(~allowed, float("-inf"))
    masked = logits.clone()
    masked[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
    return masked

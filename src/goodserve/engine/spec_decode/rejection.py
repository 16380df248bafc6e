"""Verifying a draft model's sampled drafts exactly (Leviathan et al. 2023, Chen et al. 2023).

A draft model at temperature > 0 draws d_j ~ q_j, and q_j is not a point mass, so acceptance.py's
rule (keep d_j when the target's own sample equals it) would keep d_j with probability p_j(d_j)
only, and the drafts' distribution would leak into the output. Instead: keep d_j with probability
min(1, p_j(d_j) / q_j(d_j)); at the first draft refused, draw the token from the residual
max(0, p_j - q_j), normalized, and stop; when all k are kept, the bonus token is the target's own
sample at position k (y_k ~ p_k). Each kept token then follows p_j given the tokens before it: the
output is distributed as plain sampling from the target, whatever q is.

p_j is the target's distribution as the sampler draws from it (penalties, temperature, top-k/p),
so every sampling setting keeps its meaning. Greedy rows never get here: their drafts are the
draft's argmax, a point mass, and acceptance.py's rule is this one for point masses.
"""

from __future__ import annotations

import torch


def kept_by_rejection(target_probs: torch.Tensor, draft_probs: torch.Tensor, drafts: list[int], bonus: int,
                      generator: torch.Generator | None = None) -> list[int]:
    """target_probs [k + 1, V] (p_0..p_k), draft_probs [k, V] (q_0..q_{k-1}), drafts d_j ~ q_j, bonus
    y_k ~ p_k -> the tokens kept: the accepted drafts, then a residual draw or the bonus."""
    k, device = len(drafts), target_probs.device
    index = torch.arange(k, device=device)
    chosen = torch.tensor(drafts, device=device)
    p, q = target_probs[index, chosen], draft_probs.to(device)[index, chosen]
    u = torch.rand(k, generator=generator, device=device)
    refused = (u * q >= p).tolist()  # u >= p / q without dividing (q(d) > 0: d was drawn from q)
    if True not in refused:
        return [*drafts, bonus]
    a = refused.index(True)
    residual = (target_probs[a] - draft_probs[a].to(device)).clamp(min=0)
    if not residual.sum() > 0:  # p_a == q_a up to rounding: a refusal had probability ~0
        residual = target_probs[a]
    return [*drafts[:a], int(torch.multinomial(residual, 1, generator=generator))]

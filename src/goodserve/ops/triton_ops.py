"""Small fused Triton kernels: each saves whole passes over activations that torch would make.

They compute exactly the plain-torch references in ops/norm.py, ops/rotary.py and
ops/activation.py, rounding to the activation dtype at the same points the references do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def _num_warps(block: int) -> int:
    return min(max(block // 256, 1), 16)


# ---------------------------------------------------------------------------------------------
# RMSNorm, optionally fused with the residual add before it: one read of x (+ residual), one write.


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, new_residual_ptr, stride_x, stride_r,
                     stride_o, stride_nr, hidden, eps,
                     BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # The sum is rounded to the activation dtype first, as `x + residual` is in torch.
        x = (x.to(tl.float32) + tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32))
        x = x.to(new_residual_ptr.dtype.element_ty)
        tl.store(new_residual_ptr + row * stride_nr + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    normed = (xf * rstd).to(x.dtype)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = weight.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _launch_rms_norm(x, residual, weight, eps):
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden)
    assert x2.stride(-1) == 1, "rms_norm needs the hidden dim contiguous"
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    out2 = out.view(-1, hidden)
    res2 = new_res2 = x2  # placeholders when there is no residual
    new_residual = None
    if residual is not None:
        res2 = residual.reshape(-1, hidden)
        new_residual = torch.empty_like(x)
        new_res2 = new_residual.view(-1, hidden)
    block = triton.next_power_of_2(hidden)
    if x2.shape[0] > 0:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, res2, weight, out2, new_res2, x2.stride(0), res2.stride(0), out2.stride(0), new_res2.stride(0),
            hidden, eps, BLOCK=block, HAS_RESIDUAL=residual is not None, num_warps=_num_warps(block),
        )
    return out, new_residual


def triton_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch_rms_norm(x, None, weight, eps)[0]


def triton_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual); the inputs are left untouched."""
    return _launch_rms_norm(x, residual, weight, eps)


# ---------------------------------------------------------------------------------------------
# Rotary embedding (rotate-half layout): q and k of one token in one program, cos/sin read once.


@triton.jit
def _rotate_heads(src_ptr, dst_ptr, stride_src_t, stride_src_h, stride_dst_t, stride_dst_h, token, num_heads,
                  cos, sin, half, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < num_heads) & (d < half)
    src = src_ptr + token * stride_src_t + h * stride_src_h + d
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + half, mask=mask, other=0.0).to(tl.float32)
    dst = dst_ptr + token * stride_dst_t + h * stride_dst_h + d
    tl.store(dst, (x1 * cos - x2 * sin).to(dst_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + half, (x2 * cos + x1 * sin).to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, positions_ptr, cache_ptr,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh,
                   stride_cache, num_q_heads, num_kv_heads, half,
                   BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)[None, :]
    cos = tl.load(cache_ptr + pos * stride_cache + d, mask=d < half, other=0.0)
    sin = tl.load(cache_ptr + pos * stride_cache + half + d, mask=d < half, other=0.0)
    _rotate_heads(q_ptr, q_out_ptr, stride_qt, stride_qh, stride_qot, stride_qoh, token, num_q_heads,
                  cos, sin, half, BLOCK_HQ, BLOCK_HALF)
    _rotate_heads(k_ptr, k_out_ptr, stride_kt, stride_kh, stride_kot, stride_koh, token, num_kv_heads,
                  cos, sin, half, BLOCK_HK, BLOCK_HALF)


def triton_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor, inplace: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, Hq, D], k: [T, Hk, D] (views into a fused qkv are fine), positions: [T], cache: [P, D] fp32.

    inplace=True rotates q and k where they lie and returns them; otherwise returns new tensors.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cache.stride(-1) == 1
    q_out, k_out = (q, k) if inplace else (torch.empty_like(q), torch.empty_like(k))
    half = head_dim // 2
    if num_tokens > 0:
        _rotary_kernel[(num_tokens,)](
            q, k, q_out, k_out, positions, cache, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cache.stride(0),
            num_q_heads, num_kv_heads, half,
            BLOCK_HQ=triton.next_power_of_2(num_q_heads), BLOCK_HK=triton.next_power_of_2(num_kv_heads),
            BLOCK_HALF=triton.next_power_of_2(half), num_warps=4,
        )
    return q_out, k_out


# ---------------------------------------------------------------------------------------------
# SwiGLU gate: silu(gate) * up over the fused gate|up projection, one read and one write.


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, stride_in, stride_out, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + width + cols, mask=mask, other=0.0)
    # torch rounds silu(gate) to the activation dtype before the product; so do we.
    act = (gate * tl.sigmoid(gate)).to(out_ptr.dtype.element_ty)
    out = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def triton_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [..., 2 * I] -> [..., I]."""
    width = gate_up.shape[-1] // 2
    flat = gate_up.reshape(-1, 2 * width)
    assert flat.stride(-1) == 1
    out = torch.empty(*gate_up.shape[:-1], width, dtype=gate_up.dtype, device=gate_up.device)
    block = min(triton.next_power_of_2(width), 1024)
    if flat.shape[0] > 0:
        _silu_and_mul_kernel[(flat.shape[0], triton.cdiv(width, block))](
            flat, out.view(-1, width), flat.stride(0), width, width, BLOCK=block, num_warps=4,
        )
    return out

"""Small fused Triton kernels: each saves whole passes over activations that torch would make.

They compute exactly the plain-torch references in ops/norm.py and ops/activation.py, rounding to
the activation dtype at the same points the references do, and torch.argmax for ops/sampler.py.
(RoPE is fused with the KV-cache write in ops/triton_attention.py.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from goodserve.ops.pdl import pdl_launch, pdl_sync


def row_num_warps(block: int) -> int:
    """Warps for a program that holds one row of `block` elements: 256 elements a warp, 1 to 16."""
    return min(max(block // 256, 1), 16)


# ---------------------------------------------------------------------------------------------
# RMSNorm, optionally fused with the residual add before it: one read of x (+ residual), one write.


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, new_residual_ptr, stride_x, stride_r,
                     stride_o, stride_nr, hidden, eps,
                     BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, WEIGHT_OFFSET: tl.constexpr,
                     USE_PDL: tl.constexpr):
    pdl_sync(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    add_residual_and_norm(x, row, cols, mask, residual_ptr, weight_ptr, out_ptr, new_residual_ptr, stride_r,
                          stride_o, stride_nr, hidden, eps, HAS_RESIDUAL, WEIGHT_OFFSET)


@triton.jit
def add_residual_and_norm(x, row, cols, mask, residual_ptr, weight_ptr, out_ptr, new_residual_ptr, stride_r,
                          stride_o, stride_nr, hidden, eps, HAS_RESIDUAL: tl.constexpr,
                          WEIGHT_OFFSET: tl.constexpr = 0.0):
    """One row: x (+ residual, stored as the new residual), RMS-normed and scaled by weight, into out.
    With a WEIGHT_OFFSET (Gemma's 1) the scale is offset + weight, applied before the one rounding
    (ops/norm.offset_rms_norm_torch); without, the normed row is rounded first (rms_norm_torch)."""
    if HAS_RESIDUAL:
        # The sum is rounded to the activation dtype first, as `x + residual` is in torch.
        x = (x.to(tl.float32) + tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32))
        x = x.to(new_residual_ptr.dtype.element_ty)
        tl.store(new_residual_ptr + row * stride_nr + cols, x, mask=mask)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, scaled_rms_norm(x, weight, hidden, eps, WEIGHT_OFFSET).to(
        out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def scaled_rms_norm(x, weight, hidden, eps, WEIGHT_OFFSET: tl.constexpr):
    """x (a row in the activation dtype) RMS-normed and scaled by weight (float32), in float32."""
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    if WEIGHT_OFFSET != 0.0:
        return xf * rstd * (WEIGHT_OFFSET + weight)
    return weight * (xf * rstd).to(x.dtype).to(tl.float32)


def _launch_rms_norm(x, residual, weight, eps, pdl, weight_offset=0.0):
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
            hidden, eps, BLOCK=block, HAS_RESIDUAL=residual is not None, WEIGHT_OFFSET=weight_offset,
            num_warps=row_num_warps(block),
            **pdl_launch(pdl),
        )
    return out, new_residual


def triton_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, pdl: bool = False,
                    weight_offset: float = 0.0) -> torch.Tensor:
    return _launch_rms_norm(x, None, weight, eps, pdl, weight_offset)[0]


@triton.jit
def _qk_rms_norm_kernel(qkv_ptr, q_weight_ptr, k_weight_ptr, stride_t, num_q_heads, head_dim, eps,
                        BLOCK: tl.constexpr, WEIGHT_OFFSET: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_sync(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)  # q's heads, then k's: adjacent in a row of the qkv projection
    cols = tl.arange(0, BLOCK)
    mask = cols < head_dim
    ptrs = qkv_ptr + token * stride_t + head * head_dim + cols
    x = tl.load(ptrs, mask=mask, other=0.0)
    q_weight = tl.load(q_weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # D values each, cached
    k_weight = tl.load(k_weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    weight = tl.where(head < num_q_heads, q_weight, k_weight)
    tl.store(ptrs, scaled_rms_norm(x, weight, head_dim, eps, WEIGHT_OFFSET).to(qkv_ptr.dtype.element_ty),
             mask=mask)


def triton_qk_rms_norm_(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, num_q_heads: int,
                        num_kv_heads: int, head_dim: int, eps: float, pdl: bool = False,
                        weight_offset: float = 0.0) -> None:
    """In place on the qkv projection's rows [T, (Hq + 2 Hkv) * D]: each q and k head RMS-normed over
    its D values (Qwen3, Gemma 3), in one launch; the q and k views of a split need two norm launches
    and two copies (a head's rows are strided there)."""
    assert qkv.stride(-1) == 1
    block = triton.next_power_of_2(head_dim)
    if qkv.shape[0] > 0:
        _qk_rms_norm_kernel[(qkv.shape[0], num_q_heads + num_kv_heads)](
            qkv, q_weight, k_weight, qkv.stride(0), num_q_heads, head_dim, eps, BLOCK=block,
            WEIGHT_OFFSET=weight_offset, num_warps=row_num_warps(block), **pdl_launch(pdl))


def triton_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, pdl: bool = False,
    weight_offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual); the inputs are left untouched."""
    return _launch_rms_norm(x, residual, weight, eps, pdl, weight_offset)


# ---------------------------------------------------------------------------------------------
# SwiGLU gate: silu(gate) * up over the fused gate|up projection, one read and one write.


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, stride_in, stride_out, width, BLOCK: tl.constexpr,
                         USE_PDL: tl.constexpr):
    pdl_sync(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_in + width + cols, mask=mask, other=0.0)
    out = silu_times_up(gate, up, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def silu_times_up(gate, up, dtype: tl.constexpr):
    """SwiGLU's silu(gate) * up in float32, gate and up given in the activation dtype: torch rounds
    silu(gate) to that dtype before the product, and so does every kernel here that takes SwiGLU
    in (the product's own rounding is the caller's)."""
    gate = gate.to(tl.float32)
    return (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32) * up.to(tl.float32)


def triton_silu_and_mul(gate_up: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """gate_up: [..., 2 * I] -> [..., I]."""
    width = gate_up.shape[-1] // 2
    flat = gate_up.reshape(-1, 2 * width)
    assert flat.stride(-1) == 1
    out = torch.empty(*gate_up.shape[:-1], width, dtype=gate_up.dtype, device=gate_up.device)
    block = min(triton.next_power_of_2(width), 1024)
    if flat.shape[0] > 0:
        _silu_and_mul_kernel[(flat.shape[0], triton.cdiv(width, block))](
            flat, out.view(-1, width), flat.stride(0), width, width, BLOCK=block, num_warps=4, **pdl_launch(pdl),
        )
    return out


# ---------------------------------------------------------------------------------------------
# Row argmax over a vocabulary: torch reduces a row in one thread block (~27 us for 128K float32
# logits on an H200, where the bytes take < 1 us). Here chunks of the row go to many programs, then
# one program per row picks among their candidates. Ties go to the lowest index, as in torch.argmax.


@triton.jit
def _argmax_chunks_kernel(x_ptr, value_ptr, index_ptr, stride_x, width, num_chunks, BLOCK: tl.constexpr,
                          USE_PDL: tl.constexpr):
    pdl_sync(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < width, other=float("-inf"))
    value, index = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(value_ptr + row * num_chunks + chunk, value)
    tl.store(index_ptr + row * num_chunks + chunk, chunk * BLOCK + index)


@triton.jit
def _argmax_merge_kernel(value_ptr, index_ptr, out_ptr, num_chunks, BLOCK_C: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_sync(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    values = tl.load(value_ptr + row * num_chunks + c, mask=c < num_chunks, other=float("-inf"))
    best = tl.argmax(values, axis=0, tie_break_left=True)  # the first chunk holding the maximum
    tl.store(out_ptr + row, tl.load(index_ptr + row * num_chunks + best).to(tl.int64))


ARGMAX_CHUNK = 2048


def triton_argmax(x: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """x: [N, V] float -> [N] int64, each row's first maximum (torch.argmax(x, dim=-1) on NaN-free rows)."""
    rows, width = x.shape
    assert x.stride(-1) == 1, "argmax needs rows contiguous"
    num_chunks = triton.cdiv(width, ARGMAX_CHUNK)
    values = torch.empty(rows, num_chunks, dtype=torch.float32, device=x.device)
    indices = torch.empty(rows, num_chunks, dtype=torch.int32, device=x.device)
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows > 0:
        _argmax_chunks_kernel[(rows, num_chunks)](x, values, indices, x.stride(0), width, num_chunks,
                                                 BLOCK=ARGMAX_CHUNK, num_warps=4, **pdl_launch(pdl))
        _argmax_merge_kernel[(rows,)](values, indices, out, num_chunks,
                                      BLOCK_C=triton.next_power_of_2(num_chunks), num_warps=1, **pdl_launch(pdl))
    return out

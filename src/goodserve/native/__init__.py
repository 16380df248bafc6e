"""Native CPU kernels for the decode hot path, compiled on first use (build.py).

int4_gemv: the quantized linears' few-row matmul; layer_ops: RMSNorm + residual, SiLU * mul,
RoPE + KV write, paged decode attention. Each has a torch reference that tests compare it with,
and callers fall back to that path where the library is not available. Kernels only: nothing
here imports the rest of goodserve (ops/ and quant/ call these; model/native_decode.py chains them
over a model's layers).
"""

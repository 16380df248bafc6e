"""An int4 layer on CUDA given 48 rows, on whichever goodserve is first on PYTHONPATH (a crash this
script reproduces: before the fix such a batch reached the native CPU kernel with CUDA pointers, a
segfault).

    PYTHONPATH=src python3 benchmarks/gpu_crash_check.py
"""
import torch
from torch import nn

from goodserve.quant.linear import Int4Linear

torch.manual_seed(0)
dense = nn.Linear(576, 1536, bias=False)
layer = Int4Linear.from_linear(dense, group_size=32).cuda()
x = torch.randn(48, 576)
y = layer(x.cuda().to(torch.float32)).cpu()
ref = x @ layer.dequantize(torch.float32).cpu().T
print("48 rows on CUDA: rel error", float((y - ref).norm() / ref.norm()))

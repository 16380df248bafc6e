"""Weight-only quantization (int8 / int4), its kernels and checkpoints, and the `goodserve eval` quality gate."""

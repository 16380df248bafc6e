"""Weight-only quantization (int8 / int4, GGUF's own codes): the layers, their kernels and checkpoints.
Its commands (`goodserve quantize`, the `goodserve eval` quality gate) live in commands/."""

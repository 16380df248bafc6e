"""Weight quantization (weight-only int8 / int4, GGUF's own codes; fp8 weights and activations): the
layers, their kernels and checkpoints. Its commands (`goodserve quantize`, the `goodserve eval` quality
gate) live in commands/."""

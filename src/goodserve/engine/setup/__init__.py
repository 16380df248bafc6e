"""Setting an engine up: its resolved configuration, its model, its KV pool's groups, size and tensors."""

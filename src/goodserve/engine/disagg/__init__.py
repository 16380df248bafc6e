"""Disaggregated serving: a prefill engine that hands its KV cache to the decode engine."""

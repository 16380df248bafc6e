"""`goodserve router`: one OpenAI-compatible front over R `goodserve serve` replicas (load-, prefix-aware)."""

"""The HTTP service: OpenAI-compatible API, Prometheus metrics, admission control."""

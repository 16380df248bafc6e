"""The engine, in layers (tests/unit/test_layering.py holds each to what it may import):

frontend/     requests in, outputs out: Engine, AsyncEngine, the engine process, admission
core/         scheduling, host-only and torch-free: the scheduler, its policies, the KV block accounting
seam/         the plain data a step carries from the scheduler to the workers and back
worker/       the executor and its workers: the model runner, its inputs, the ranks' plumbing
spec_decode/  speculative decoding: proposers, the policy that sizes drafts, the verifiers
setup/        resolving the configuration, building the model, sizing and allocating the KV pool
processes/    what every process goodserve starts shares: its startup heap, how it stops
disagg/       disaggregated serving: a prefill engine handing its KV cache to the decode engine
"""

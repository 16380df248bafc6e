"""The custom all-reduce's CPU-visible side (its CUDA path runs in benchmarks/gpu_allreduce.py, on 2
GPUs): which tensors it takes, the fallback where it cannot be set up, and its off switch's way from
the command line and LLM to the config."""

from __future__ import annotations

import argparse
import logging

import pytest
import torch
import torch.distributed as dist

from goodserve import LLM
from goodserve.engine_args import add_engine_arguments, engine_config_from_args
from goodserve.model.custom_all_reduce import CustomAllReduce, set_up_custom_all_reduce
from goodserve.model.tensor_parallel import TensorParallel

BUFFER_BYTES = 1024


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def custom() -> CustomAllReduce:
    return CustomAllReduce(torch.empty(BUFFER_BYTES, dtype=torch.uint8), "0")


@pytest.mark.parametrize("x, takes", [
    (torch.ones(BUFFER_BYTES // 2, dtype=torch.bfloat16), True),  # the buffer, exactly
    (torch.ones(BUFFER_BYTES // 4, dtype=torch.float32), True),
    (torch.ones(BUFFER_BYTES // 2 + 2, dtype=torch.bfloat16), False),  # larger than the buffer: NCCL
    (torch.ones(16, dtype=torch.float16), False),  # a type torch's one-shot kernel does not sum
    (torch.ones(3, dtype=torch.bfloat16), False),  # 6 bytes: not whole 4-byte words
    (torch.ones(8, 4, dtype=torch.bfloat16).t(), False),  # not contiguous
    (torch.ones(0, dtype=torch.bfloat16), False),
])
def test_small_tensors_of_the_kernels_types_take_the_custom_all_reduce(x, takes):
    assert custom().takes(x) is takes


def test_a_tensor_too_large_for_the_buffer_is_summed_in_place_by_the_process_group(one_rank_group):
    tp = TensorParallel(0, 2, custom_all_reduce=custom())
    x = torch.ones(BUFFER_BYTES, dtype=torch.float32)
    assert tp.all_reduce(x) is x


def test_on_the_cpu_there_is_no_custom_all_reduce_and_the_log_says_why(one_rank_group, caplog):
    with caplog.at_level(logging.INFO, logger="goodserve.engine"):
        assert set_up_custom_all_reduce(None, torch.device("cpu"), 512 << 10) is None
    assert "tensor-parallel all-reduce: gloo (no custom all-reduce: tensors on the CPU)" in caplog.messages


def test_disable_custom_all_reduce_reaches_the_config_from_the_command_line_and_llm():
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert engine_config_from_args(parser.parse_args(["--disable-custom-all-reduce"])).disable_custom_all_reduce
    assert not engine_config_from_args(parser.parse_args([])).disable_custom_all_reduce
    llm = LLM("dummy:tiny", dtype="float32", num_kv_blocks=16, disable_custom_all_reduce=True)
    assert llm.engine.config.disable_custom_all_reduce

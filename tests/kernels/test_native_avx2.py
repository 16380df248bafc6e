"""The native kernels as machines without AVX-512 run them (AMD Zen 2 / 3, Intel before Skylake-X):
built here for x86-64-v3 (AVX2, FMA, F16C), they are other code (int4_gemv.cpp's `tile_avx2` and
8-lane int8 tiles, q8_gemv.cpp's, decode attention in 8-lane registers), so CI on an AVX-512 machine
would otherwise never run them. The kernel and decode-stack tests must pass on that build, none of
them skipped, and its int8-activation path must give this build's floats exactly: the integer dots
are exact and each lane sums the same products in the same order on either width."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from goodserve.native import build

TESTS = Path(__file__).parent
ROOT = TESTS.parents[1]
pytestmark = pytest.mark.skipif(" avx2 " not in f" {build.cpu_flags().strip()} " or build.compiler() is None,
                                reason="needs an x86 CPU with AVX2 and a compiler")

INT8_PRODUCTS = """
import sys, torch
sys.path.insert(0, {tests!r})
from goodserve.native.int4_gemv import Int4Layout, int8_dot_available
from test_native_kernels import int4_layer
assert int8_dot_available()
outs = []
for n, k, group_size, m in [(64, 576, 32, 1), (30, 384, 128, 3), (1536, 576, 32, 4), (577, 1536, 64, 9)]:
    layer = int4_layer(n, k, group_size, seed=n)
    layer.scales.copy_(layer.scales.half().float())
    layer.zeros.copy_(layer.zeros.half().float())
    layout = Int4Layout.from_codes(layer.qweight, layer.scales, layer.zeros, group_size)
    layout.int8_activations = True
    outs.append(layout.matmul(torch.randn(m, k, generator=torch.Generator().manual_seed(m))))
torch.save(outs, sys.argv[1])
"""


def avx2_env(cache: Path) -> dict[str, str]:
    return {**os.environ, "GOODSERVE_NATIVE_MARCH": "x86-64-v3", "GOODSERVE_CACHE_DIR": str(cache),
            "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}


@pytest.mark.slow  # builds the native library a second time
def test_the_avx2_build_passes_the_kernel_tests(tmp_path):
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                             str(TESTS / "test_native_kernels.py"), str(TESTS / "test_native_decode.py")],
                            env=avx2_env(tmp_path), capture_output=True, text=True, cwd=ROOT)
    summary = result.stdout.strip().splitlines()[-1]
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "skipped" not in summary, result.stdout[-3000:]


@pytest.mark.skipif(" avx512bw " not in f" {build.cpu_flags().strip()} ", reason="compares with the AVX-512 build")
@pytest.mark.slow
def test_the_avx2_int8_path_gives_the_avx512_floats(tmp_path):
    script = INT8_PRODUCTS.format(tests=str(TESTS))
    for name, env in (("avx2", avx2_env(tmp_path / "avx2")), ("native", {**avx2_env(tmp_path / "native"),
                                                                         "GOODSERVE_NATIVE_MARCH": "native"})):
        subprocess.run([sys.executable, "-c", script, str(tmp_path / f"{name}.pt")], env=env, check=True)
    avx2, native = torch.load(tmp_path / "avx2.pt"), torch.load(tmp_path / "native.pt")
    assert all(torch.equal(a, b) for a, b in zip(avx2, native, strict=True))

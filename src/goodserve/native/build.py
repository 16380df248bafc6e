"""Compiles the native CPU kernels (the .cpp files beside this one) on first use and loads them.

Plain C ABI over ctypes, not a torch extension: the sources include no torch headers, so a build
takes about a second instead of most of a minute. Threads come from OpenMP: the library asks for
libgomp.so.1, the soname of the copy torch ships and has already loaded, so the dynamic linker
binds both to one runtime and one thread pool (two runtimes would spin against each other on
2 cores). -march=native is safe because the build runs on the machine that runs it; the cache key
holds the CPU's flags for a home directory shared between machines. GOODSERVE_NATIVE_MARCH
(x86-64-v3, say) builds for another instruction set instead: the tests build the AVX2 kernels
that way on an AVX-512 machine.

The built library is cached under $GOODSERVE_CACHE_DIR (default ~/.cache/goodserve), keyed by a
hash of the sources, flags, compiler and CPU. No compiler, a failed build or GOODSERVE_NATIVE=0:
`library()` returns None after one log line, and every caller keeps its torch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch  # noqa: F401  (loads torch's libgomp first, so the library binds to it)

logger = logging.getLogger("goodserve.native")

SOURCE_DIR = Path(__file__).parent
SOURCES = ("int4_gemv.cpp", "q8_gemv.cpp", "decode_attention.cpp", "layer_ops.cpp", "decoder_layer.cpp")
HEADERS = ("vec.h",)
FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=c++17", "-fno-math-errno")
LIBRARY_NAME = "libgoodserve_native.so"
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
# Every exported kernel's C signature (argument types, return type): ctypes checks and converts the
# arguments by these, so a float passed where the C code takes one is not read as an integer.
SIGNATURES = {
    "gs_int4_gemv": ([_P, _I, _P, _P, _I, _I, _I, _I, _I, ctypes.c_int, ctypes.c_int, ctypes.c_int], ctypes.c_int),
    "gs_int8_dot_available": ([], ctypes.c_int),
    "gs_half_scales_available": ([], ctypes.c_int),
    "gs_q8_gemv": ([_P, _I, _P, _P, _I, _I, _I, _I, ctypes.c_int], None),
    "gs_add_rms_norm": ([_P, _P, _P, _P, _P, _I, _I, _F], None),
    "gs_silu_and_mul": ([_P, _P, _I, _I], None),
    "gs_rope_write_kv": ([_P, _I, _P, _I, _P, _I, _P, _P, _P, _P, _P, _I, _I, _I, _I], None),
    "gs_decode_attention": ([_P, _I, _P, _P, _P, _I, _I, _P, _P, _I, _I, _I, _I, _I, _F, _I, ctypes.c_int], None),
    "gs_decoder_stack": ([_P, _I, _P, _P, _P, _P, _P, _I, _P, _P, _P, _I, _P, _I, _I, _P, ctypes.c_int], None),
}


def cache_root() -> Path:
    return Path(os.environ.get("GOODSERVE_CACHE_DIR", Path.home() / ".cache" / "goodserve"))


def compiler() -> str | None:
    return next((c for c in (os.environ.get("CXX"), "g++", "c++", "clang++") if c and shutil.which(c)), None)


def cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def flags() -> tuple[str, ...]:
    return (*FLAGS, f"-march={os.environ.get('GOODSERVE_NATIVE_MARCH', 'native')}")


def build_key(cxx: str) -> str:
    digest = hashlib.sha256()
    for name in SOURCES + HEADERS:
        digest.update((SOURCE_DIR / name).read_bytes())
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout
    for part in (" ".join(flags()), version, cpu_flags(), platform.machine()):
        digest.update(part.encode())
    return digest.hexdigest()[:16]


def compile_library(cxx: str, target: Path) -> None:
    """Builds into a temporary file first: concurrent processes (tests, server workers) may race."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / LIBRARY_NAME
        command = [cxx, *flags(), *(str(SOURCE_DIR / s) for s in SOURCES), "-o", str(out)]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-2000:]}")
        os.replace(out, target)


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    for name, (argtypes, restype) in SIGNATURES.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, restype
    return lib


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernels, building them if needed; None (logged once) where they cannot be had."""
    if os.environ.get("GOODSERVE_NATIVE", "1") == "0":
        logger.info("native CPU kernels off (GOODSERVE_NATIVE=0); using the torch paths")
        return None
    try:
        cxx = compiler()
        if cxx is None:
            raise RuntimeError("no C++ compiler found (set CXX)")
        target = cache_root() / "native" / build_key(cxx) / LIBRARY_NAME
        if not target.exists():
            compile_library(cxx, target)
        return declare(ctypes.CDLL(str(target)))
    except Exception as exc:  # any failure means the torch path, never a crash
        logger.warning("native CPU kernels unavailable, using the torch paths: %s", exc)
        return None

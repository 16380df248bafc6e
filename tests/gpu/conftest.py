"""The GPU regression gate (docs/testing.md): fixtures, the skip without CUDA, and the JSON summary.

The CPU suite never collects this folder (pyproject's addopts: --ignore=tests/gpu); `pytest tests/gpu`
does. Without CUDA every test here is skipped, unless GOODSERVE_GATE_DEVICE=cpu asks for the small
subset that means something on a CPU (tiny models, the torch paths), for working on the suite.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch

GATE_DIR = Path(__file__).parent


def gate_device() -> str | None:
    """'cuda', 'cpu' (opted in with GOODSERVE_GATE_DEVICE=cpu), or None: the gate cannot run here."""
    if os.environ.get("GOODSERVE_GATE_DEVICE") == "cpu":
        return "cpu"
    return "cuda" if torch.cuda.is_available() else None


DEVICE = gate_device()
if DEVICE == "cuda":
    # tests/conftest.py turns on Triton's interpreter for the CPU suite; on a GPU it would run every
    # kernel in Python. Triton reads this when it decorates a kernel, so before anything imports it.
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") == "1":
        raise pytest.UsageError("triton was imported with TRITON_INTERPRET=1: run the gate with TRITON_INTERPRET=0")
    os.environ["TRITON_INTERPRET"] = "0"


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="the GPU gate needs CUDA (GOODSERVE_GATE_DEVICE=cpu runs its CPU subset)")
    for item in items:
        if GATE_DIR in item.path.parents:
            item.add_marker(pytest.mark.gpu)
            if DEVICE is None:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def device() -> str:
    return DEVICE


@pytest.fixture(scope="session")
def cuda_only(device):
    if device != "cuda":
        pytest.skip("CUDA-only case (the CPU suite covers the CPU paths)")


@pytest.fixture(autouse=True)
def release_gpu_memory():
    """Each case builds its own engines; free their KV caches and graph pools before the next."""
    from goodserve.engine.setup.device_memory import release_dropped_memory

    yield
    release_dropped_memory()


@pytest.fixture(scope="session")
def hf_dir(tmp_path_factory) -> Path:
    """A tiny random Llama as a Hugging Face safetensors directory (no tokenizer: prompts are ids).
    dummy:tiny's shape, so the Triton kernels compiled for one serve the other; a wide initializer
    gives peaked logits, so a wrong kernel moves the greedy choice instead of drowning in a flat
    distribution."""
    import transformers
    from test_loaders import save_tiny_hf_model

    from goodserve.model.presets import get_preset

    tiny = get_preset("tiny")
    config = transformers.LlamaConfig(
        vocab_size=tiny.vocab_size, hidden_size=tiny.hidden_size, intermediate_size=tiny.intermediate_size,
        num_hidden_layers=tiny.num_layers, num_attention_heads=tiny.num_heads, num_key_value_heads=tiny.num_kv_heads,
        max_position_embeddings=tiny.max_position_embeddings, tie_word_embeddings=False, initializer_range=0.2)
    path = tmp_path_factory.mktemp("hf_tiny_llama")
    save_tiny_hf_model(config, path)
    return path


@pytest.fixture(scope="session")
def hf_embedded_on_device(hf_embedded, device):
    """tests/conftest.py's transformers model of the embedded GGUF file, moved to the gate's device."""
    return hf_embedded.to(device)


# ---- the JSON summary ---------------------------------------------------------------------------
# Written after every test, so a crash (a segfault takes pytest with it) leaves the cases run so far
# and names the one that was running.

def _summary_path() -> Path | None:
    if os.environ.get("GOODSERVE_GATE_OUT"):
        return Path(os.environ["GOODSERVE_GATE_OUT"])
    return Path(os.environ["OUT"]) / "gpu_gate.json" if os.environ.get("OUT") else None


def _environment() -> dict:
    import transformers

    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "device": DEVICE,
        "card": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
        "torch": torch.__version__, "triton": triton_version, "transformers": transformers.__version__,
        "python": sys.version.split()[0], "commit": os.environ.get("GOODSERVE_GATE_COMMIT"),
    }


def _why(report) -> str:
    """A skip's reason, or a failure's `E` lines (the assertion and its message)."""
    if report.skipped and isinstance(report.longrepr, tuple):
        return report.longrepr[2]
    lines = report.longreprtext.splitlines()
    return "\n".join([line for line in lines if line.startswith("E ")][:8] or lines[-1:])[:1000]


class GateSummary:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.started = time.time()
        self.cases: dict[str, dict] = {}
        self.running: str | None = None
        self.environment: dict | None = None

    def write(self, exit_status: int | None = None) -> None:
        self.environment = self.environment or _environment()
        cases = list(self.cases.values())
        summary = {
            **self.environment,
            "seconds": round(time.time() - self.started, 1),
            "finished": exit_status is not None, "exit_status": exit_status, "running": self.running,
            "passed": sum(c["outcome"] == "passed" for c in cases),
            "failed": sum(c["outcome"] == "failed" for c in cases),
            "skipped": sum(c["outcome"] == "skipped" for c in cases),
            "cases": cases,
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(summary, indent=1, default=str))
        tmp.replace(self.path)

    def pytest_runtest_logstart(self, nodeid, location):
        self.running = nodeid
        self.write()

    def pytest_runtest_logreport(self, report):
        case = self.cases.setdefault(report.nodeid, {
            "name": report.nodeid.split("::", 1)[-1], "passed": False, "outcome": "passed", "seconds": 0.0})
        case["seconds"] = round(case["seconds"] + report.duration, 2)
        if report.outcome != "passed" and case["outcome"] == "passed":
            case["outcome"] = report.outcome
            case["why"] = _why(report)
        case.update(dict(report.user_properties))
        case["passed"] = case["outcome"] == "passed"
        if report.when == "teardown":
            self.running = None
            self.write()

    def pytest_sessionfinish(self, session, exitstatus):
        self.write(int(exitstatus))


def pytest_configure(config):
    path = _summary_path()
    if path is not None and DEVICE is not None:
        config.pluginmanager.register(GateSummary(path), "goodserve_gate_summary")

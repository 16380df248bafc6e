"""Online serving beside vLLM: each engine's OpenAI-compatible server at its defaults, loaded by
`goodserve bench` over HTTP alike (Poisson arrivals, ignore_eos, the same synthetic tokenizer), for
goodput at TTFT <= 200 ms and TPOT <= 50 ms: a capacity search (the highest rate whose SLO
attainment stays >= 90%) or a fixed ladder of rates.

goodserve: `goodserve serve --model dummy:llama-3.1-8b --tokenizer DIR`; its resolved configuration
comes back in bench's result (`engine_config`, from its /metrics). vLLM: `vllm serve DIR
--load-format dummy --dtype bfloat16` over a directory holding the config.json and the tokenizer;
what it resolved is its config rebuilt as the server builds it (`settings`) and the lines of its
startup log that name settings (`settings_log`).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from goodserve.bench.capacity import capacity_of
from peer_model import GOODSERVE_MODEL, VLLM_ENGINE_ARGS, tokenizer_for, vllm_model_dir
from peer_vllm_settings import server_settings, settings_log

SLO_ATTAINMENT_TARGET = 0.9
SLO_ARGS = ["--goodput", "ttft:200", "tpot:50", "--slo-attainment-target", str(SLO_ATTAINMENT_TARGET)]
# goodserve told the same targets: its slo policy (batch sized from the TPOT target, the costliest
# requests refused first once TTFT is at risk). Refused requests count against its attainment.
GOODSERVE_FLAGS = {"goodserve": [], "goodserve-slo": ["--scheduler-policy", "slo", "--slo-ttft-ms", "200",
                                                      "--slo-tpot-ms", "50", "--slo-shed-costly"]}


@dataclass
class OnlinePlan:
    """What one engine's online run sends: the bench workload flags, prompts per probe, and either
    the capacity search (rates None) or the rates of a fixed ladder."""
    workload: list[str]
    num_prompts: int
    rates: list[float] | None
    start_rate: float = 16.0
    bisections: int = 2
    num_warmups: int = 4

    def rate_args(self) -> list[str]:
        if self.rates is None:
            return ["--goodput-capacity", "--capacity-start-rate", f"{self.start_rate:g}",
                    "--capacity-bisections", str(self.bisections), "--capacity-max-doublings", "4"]
        return ["--sweep-request-rates", ",".join(f"{r:g}" for r in self.rates)]


def engine_env(engine: str, vllm_site: str) -> dict[str, str]:
    """This process's environment for one engine's process: vLLM's own package folder (its pinned
    fastapi, pydantic, openai...) first on the path of vLLM's processes, off the path of goodserve's,
    so each runs with the packages its users install with it."""
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != vllm_site]
    if engine == "goodserve":
        return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    # FlashInfer is not carried: its top-k/top-p sampler (unused by greedy requests) is turned off,
    # since vLLM 0.26.0 imports FlashInfer unguarded when deciding whether to use it. Nothing is fetched.
    return {**os.environ, "PYTHONPATH": os.pathsep.join([vllm_site, *paths]), "VLLM_USE_FLASHINFER_SAMPLER": "0",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def start_goodserve(model: str, device: str, tokenizer: str, env: dict[str, str], flags: list[str]):
    from goodserve.server.process import start_server

    args = ["--model", model, "--tokenizer", tokenizer, *flags] + (["--device", device] if device != "auto" else [])
    return start_server(args, env)


def start_vllm(model_dir: str, env: dict[str, str]):
    """`vllm serve` in a session of its own (its engine core is a child process: the whole group is
    signalled at the end, so no GPU memory outlives the run)."""
    from goodserve.ports import free_port
    from goodserve.server.process import ServerProcess

    port = free_port()
    log_path = tempfile.mkstemp(prefix="vllm-serve-", suffix=".log")[1]
    flags = [item for key, value in VLLM_ENGINE_ARGS.items() for item in (f"--{key.replace('_', '-')}", value)]
    command = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model_dir, *flags,
               "--served-model-name", GOODSERVE_MODEL, "--host", "127.0.0.1", "--port", str(port)]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return ServerProcess(process, f"http://127.0.0.1:{port}", Path(log_path), name="vllm serve")


def stop(server, engine: str) -> None:
    server.stop()
    if engine == "vllm":
        try:
            os.killpg(server.process.pid, signal.SIGKILL)  # what its own shutdown left (a session of its own)
        except ProcessLookupError:
            pass


def bench(url: str, served_name: str, tokenizer: str, plan: OnlinePlan, out_dir: str, filename: str,
          timeout_s: float, env: dict[str, str]) -> dict:
    """bench's result (its table and messages in out_dir/filename.log); "error" holds the log's end
    when a request failed."""
    command = [sys.executable, "-m", "goodserve.cli", "bench", "--base-url", url, "--model", served_name,
               "--tokenizer", tokenizer, *plan.workload, "--num-prompts", str(plan.num_prompts), "--ignore-eos",
               *SLO_ARGS, "--num-warmups", str(plan.num_warmups), *plan.rate_args(), "--save-result",
               "--result-dir", out_dir, "--result-filename", filename, "--disable-tqdm"]
    path, log_path = os.path.join(out_dir, filename), os.path.join(out_dir, filename + ".log")
    with open(log_path, "w") as log:
        code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s, env=env).returncode
    result = json.load(open(path)) if os.path.exists(path) else {}
    if code != 0 or not result:
        result["error"] = f"bench exit {code}: " + open(log_path, errors="replace").read()[-1500:]
    return result


def probe_summary(run: dict) -> dict:
    keys = ("request_rate", "sustained_request_rate", "slo_attainment", "request_goodput", "completed", "failed",
            "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "output_throughput", "duration")
    return {key: run.get(key) for key in keys}


def serve_and_bench(engine: str, plan: OnlinePlan, out_dir: str, filename: str, timeout_s: float,
                    model: str = GOODSERVE_MODEL, device: str = "auto", vllm_site: str = "/tmp/vsite") -> dict:
    """One engine's server (vllm, or goodserve with GOODSERVE_FLAGS[engine]) started, loaded by bench,
    stopped; its result summarized (bench's whole result stays in out_dir/filename, its output in
    filename.log, the server's in filename.server.log)."""
    deadline = time.monotonic() + timeout_s
    os.makedirs(out_dir, exist_ok=True)
    served_name = GOODSERVE_MODEL if engine == "vllm" else model  # each server's default name
    tokenizer = tokenizer_for(served_name, tempfile.mkdtemp(prefix="tok-"))
    start = time.perf_counter()
    client_env, vllm_env = engine_env("goodserve", vllm_site), engine_env("vllm", vllm_site)  # bench is goodserve's
    model_dir = vllm_model_dir() if engine == "vllm" else None
    server = (start_vllm(model_dir, vllm_env) if model_dir
              else start_goodserve(model, device, tokenizer, client_env, GOODSERVE_FLAGS[engine]))
    result: dict = {"engine": engine, "workload": plan.workload, "num_prompts": plan.num_prompts,
                    "mode": "capacity" if plan.rates is None else "ladder"}
    try:
        server.wait_ready(max(deadline - time.monotonic(), 1.0))
        result["startup_s"] = time.perf_counter() - start
        run = bench(server.url, served_name, tokenizer, plan, out_dir, filename,
                    max(deadline - time.monotonic(), 1.0), client_env)
        runs = run.get("sweep", [run]) if "request_rate" in run or "sweep" in run else []
        # a ladder's capacity as the search reads its probes: the best rate held at >= 90% attainment
        capacity = run.get("capacity") or (capacity_of(runs, SLO_ATTAINMENT_TARGET) if runs else None)
        result.update({"probes": [probe_summary(r) for r in runs], "capacity": capacity,
                       "engine_config": run.get("engine_config"), "error": run.get("error"),
                       "result_file": filename})
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        result["error"] = f"{type(exc).__name__}: {str(exc)[-2000:]}"
    finally:
        stop(server, engine)
        shutil.copyfile(server.log_path, os.path.join(out_dir, filename + ".server.log"))
        if model_dir:
            result["settings_log"] = settings_log(server.log())
            result["settings"] = server_settings({"model": model_dir, **VLLM_ENGINE_ARGS}, vllm_env,
                                                 min(120.0, max(deadline - time.monotonic(), 1.0)))
        result["server_log_tail"] = server.log()[-1500:] if result.get("error") else None
    result["capacity_rate"] = (result.get("capacity") or {}).get("rate")
    return {key: value for key, value in result.items() if value is not None}

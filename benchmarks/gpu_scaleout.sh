#!/usr/bin/env bash
# Issue 16's serving measurements on a 2-GPU kind: replicas behind the router (gpu_router.py: the
# fixed-rate check, then the goodput capacity searches) and prefill / decode disaggregation against
# two colocated replicas (gpu_disagg.py, each setup a step of its own). Device calls of at most 600 s,
# sent back to back so that they keep one machine: `capacity1` (one replica), `capacity2` (two behind
# the router), `colocated,disagg`, `fixed`. Each step has its own time limit, so one that hangs leaves
# the next its time, and its summary lands in $OUT as it ends.
#
#   carry: [".gate/whl", ".gate/whl_fast", ".gate/tok"]   (scripts/gpu_wheels.sh, benchmarks/export_tokenizer.py)
#   command: bash benchmarks/gpu_scaleout.sh STEPS        STEPS: capacity1, capacity2, colocated,disagg, or fixed
#            (FIXED_RATE=64 bash benchmarks/gpu_scaleout.sh fixed: the fixed step at 64 req/s a replica)
set -uo pipefail
cd "$(dirname "$0")/.."
STEPS=${1:?"which steps: capacity1, capacity2, colocated,disagg, or fixed"}
OUT=${OUT:-out}
SITE=${SITE:-/tmp/site}
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" .gate/whl/*.whl \
  .gate/whl_fast/*.whl 2>&1 | grep -v WARNING
export PYTHONPATH="$SITE:$PWD/src:$PWD/benchmarks"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # the device README's rule
nvidia-smi -L

step() {  # name, seconds, command...
  local name=$1 limit=$2 && shift 2
  [[ ",$STEPS," == *",$name,"* ]] || return 0
  mkdir -p "$OUT/$name"
  local started=$SECONDS
  OUT="$OUT/$name" timeout "$limit" "$@" > "$OUT/$name/log.txt" 2>&1
  echo "$name: exit $? after $((SECONDS - started)) s"
  rm -f "$OUT/$name"/router_*.json "$OUT/$name"/disagg_*.json  # per-request records: too large to bring back
}

# FIXED_RATE req/s a replica (default 48, where one replica's capacity search last passed) for 50 s a
# side: long enough to reach steady state, which the searches' probes do not
FIXED_RATE=${FIXED_RATE:-48}
step fixed 330 python3 benchmarks/gpu_router.py --tokenizer .gate/tok --phases fixed \
  --num-prompts "$(python3 -c "print(round(50 * $FIXED_RATE))")" --fixed-rate "$FIXED_RATE"
# 800 prompts a replica a probe (400 left the probes short of steady state): each side a call of its own
step capacity1 560 python3 benchmarks/gpu_router.py --tokenizer .gate/tok --phases capacity --num-prompts 800 \
  --capacity-sides one
step capacity2 560 python3 benchmarks/gpu_router.py --tokenizer .gate/tok --phases capacity --num-prompts 800 \
  --capacity-sides routed
step colocated 270 python3 benchmarks/gpu_disagg.py --tokenizer .gate/tok --num-prompts 120 --setups colocated
step disagg 300 python3 benchmarks/gpu_disagg.py --tokenizer .gate/tok --num-prompts 120 --setups disagg
for name in fixed capacity1 capacity2 colocated disagg; do  # (an `&&` list here made the call's status 1 when the last was not run)
  if [ -f "$OUT/$name/log.txt" ]; then echo "== $name"; tail -c 1500 "$OUT/$name/log.txt"; fi
done

#!/usr/bin/env bash
# Issue 16's tensor-parallel measurements in one device call on a 4-GPU kind (2 GPUs: the TP=4 and 70B
# steps are skipped): the all-reduce kernels checked and timed (gpu_allreduce.py: one-shot and fused with
# add + RMSNorm against NCCL and the unfused pair); a float32 check that TP's greedy tokens are TP=1's;
# batch-1 decode of the 70B at TP=4, then its ShareGPT-like offline batch; the 8B at TP=1, 2, 4.
# Each step has its own time limit and writes to $OUT/<step>/; a failed all-reduce check stops the call
# (the decode steps would run the same kernels).
#
#   carry: [".gate/whl"]        command: bash benchmarks/gpu_tp.sh [STEPS]   (default allreduce,tpf32,tp70b,tp8b)
set -uo pipefail
cd "$(dirname "$0")/.."
STEPS=${1:-allreduce,tpf32,tp70b,tp8b}
OUT=${OUT:-out}
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .gate/whl/*.whl 2>&1 | grep -v WARNING
export PYTHONPATH="/tmp/site:$PWD/src:$PWD/benchmarks"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # the device README's rule
nvidia-smi -L
GPUS=$(nvidia-smi -L | wc -l)

step() {  # name, seconds, command...
  local name=$1 limit=$2 && shift 2
  [[ ",$STEPS," == *",$name,"* ]] || return 0
  mkdir -p "$OUT/$name"
  local started=$SECONDS status
  OUT="$OUT/$name" timeout "$limit" "$@" > "$OUT/$name/log.txt" 2>&1
  status=$?
  echo "$name: exit $status after $((SECONDS - started)) s"
  tail -n 25 "$OUT/$name/log.txt"
  return $status
}

step allreduce 90 python3 benchmarks/gpu_allreduce.py --gpus "$GPUS" --sizes-kb 16,64,512 || exit 1
# float32: TP's greedy tokens are TP=1's (bf16's rounding of split sums moves near ties)
step tpf32 150 python3 benchmarks/gpu_tp.py --model dummy:llama-3.2-1b --dtype float32 --new-tokens 64 \
  --sizes "$( [ "$GPUS" -ge 4 ] && echo 1,2,4 || echo 1,2 )" --all-reduce fused,custom
if [ "$GPUS" -ge 4 ]; then
  step tp70b 260 python3 benchmarks/gpu_tp.py --model dummy:llama-3.1-70b --sizes 4 --new-tokens 128 \
    --offline 500 --max-num-seqs 256
  step tp8b 200 python3 benchmarks/gpu_tp.py --sizes 1,2,4 --all-reduce fused
else
  step tp8b 240 python3 benchmarks/gpu_tp.py --sizes 1,2 --all-reduce fused,custom
fi

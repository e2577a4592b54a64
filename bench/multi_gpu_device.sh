#!/usr/bin/env bash
# One device call of the two-GPU bench (issue 16) on a lent GPU host; results in bench/results/multi-gpu.md.
#   bash bench/multi_gpu_device.sh RUN...     RUN: disagg | ddp | zero2 | ddpcheck | zero2check (the N-vs-1 check alone)
# Needs, carried: .whl/ (ray repacked without ray/jars, deepspeed built with DS_BUILD_OPS=0, and the
# other wheels the image lacks: ../shared/MEASURED.md "Ray on the lent GPU machines") and
# .devcache/tokenizer (bench/multi_gpu_device.py says how to make it). Writes logs and one table per
# run under $OUT (tee: a run cut short still leaves its log). RUN_TIMEOUT_S bounds each run.
set -uo pipefail
# NVLink multicast stays off in every process (the lender's multi-GPU hosts; KINDS.md says why).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
  GRPC_ENABLE_FORK_SUPPORT=false TOKENIZERS_PARALLELISM=false COUNTERPOINT_CACHE=/tmp/cp-cache
OUT=${OUT:-/tmp/cp-out}
mkdir -p "$OUT"
if [ ! -f /tmp/site/.cp-installed ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && touch /tmp/site/.cp-installed || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD
python3 bench/multi_gpu_device.py --tokenizer .devcache/tokenizer 2>&1 | tee -a "$OUT/prep.log" || exit 1

CONFIG=configs/multi-gpu-2gpu.yaml
SHARED=(--set learner.workers=2 --set learner.gpus_per_worker=0.6 --set rollout.num_gpus=0.4)
status=0
for run in "$@"; do
  case "$run" in
    disagg) args=(--no-ddp-check --title "Disaggregated: rollout replica on one GPU, learner worker on the other") ;;
    ddp) args=("${SHARED[@]}" --title "Learner on both GPUs (DDP over NCCL), rollout sharing a GPU") ;;
    zero2) args=("${SHARED[@]}" --set learner.deepspeed=true --title "Learner on both GPUs (DeepSpeed ZeRO-2), rollout sharing a GPU") ;;
    ddpcheck) args=("${SHARED[@]}" --check-only --title "DDP: the learner's 2 workers vs 1 worker") ;;
    zero2check) args=("${SHARED[@]}" --set learner.deepspeed=true --check-only
                      --title "ZeRO-2: the learner's 2 workers vs 1 worker") ;;
    *) echo "unknown run $run (disagg | ddp | zero2 | ddpcheck | zero2check)"; exit 2 ;;
  esac
  echo "=== $run start $(date +%T)"
  limit_var="TIMEOUT_$run"  # e.g. TIMEOUT_zero2=330 overrides RUN_TIMEOUT_S for that run
  timeout -k 15 "${!limit_var:-${RUN_TIMEOUT_S:-300}}" python3 bench/multi_gpu.py --config "$CONFIG" "${args[@]}" \
    --run-name "multi-gpu-$run" --out "$OUT/multi-gpu-$run.md" 2>&1 | tee "$OUT/$run.log"
  rc=$?
  echo "=== $run exit $rc $(date +%T)"
  if [ "$rc" -ne 0 ]; then
    status=1
    # A run cut short leaves its local Ray cluster behind; the next run must start a fresh one.
    python3 -m ray.scripts.scripts stop --force >/dev/null 2>&1
  fi
done
nvidia-smi --query-gpu=index,memory.used --format=csv | tee -a "$OUT/prep.log"
exit $status

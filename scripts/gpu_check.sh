#!/usr/bin/env bash
# GPU checks, prepared to run as one script on a machine with an NVIDIA GPU and torch (the lent
# device machine, or the Coalesce container): under 8 minutes, results in perf/results/gpu-check-*.
#   bash scripts/gpu_check.sh            # uses .venv/bin/python when present, else python3
# What runs depends on what is installed, and each skipped part says why:
#   1. torch on CUDA (fp32, fp16, CUDA graphs) against ONNX Runtime on the CPU: cosine >= 0.999, timings
#   2. ONNX Runtime GPU providers, when onnxruntime-gpu is installed
#   3. TensorRT: build an engine with profiles from the config, run it, compare; when `tensorrt` imports
#   4. tinylm's generation engine (tests/models/) on CUDA (fp32, fp16) against transformers' generate, tokens/s
#   5. Triton with the KIND_GPU config against the CPU config (embeddings, perf_analyzer), when a
#      tritonserver and the serve extra are installed
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && PY=.venv/bin/python
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
export PYTHONPATH="backends/coalesce:backends:client:.${PYTHONPATH:+:$PYTHONPATH}"
exec timeout 470 "$PY" scripts/gpu_check.py "$@"

#!/usr/bin/env bash
# Idempotent set-up of the peers `python -m perf.peers` compares Coalesce with, each in its own
# virtual environment under .bench/ (they pin libraries the project's .venv cannot hold: Infinity
# wants numpy<2 and its own transformers, Ray Serve its own pydantic and starlette). A venv whose
# stamp matches the pins below is kept, so a second run takes a second.
#   bash scripts/setup_peers.sh            # both peers
#   bash scripts/setup_peers.sh ray        # one of: infinity, ray
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
BENCH=.bench
say() { printf 'setup_peers: %s\n' "$*" >&2; }

# Exact versions, verified together with perf.peers on CPU (2026-12-04). torch is pinned first and
# again with the rest: an unpinned resolve would take the CUDA build (gigabytes) instead of the CPU
# wheel. Infinity 0.0.78 resolves optimum 2.x, whose OptimizationConfig lacks the argument Infinity's
# graph optimisation passes, so Infinity serves the ONNX graph unoptimised (as the shipped graph is
# for every system here); optimum 1.x, which it was written for, does not import with torch 2.13.
INFINITY_PINS=(
  "torch==2.13.0"
  "infinity-emb[server,torch,optimum]==0.0.78"
  "optimum==2.1.0" "optimum-onnx==0.1.0" "transformers==4.57.6" "sentence-transformers==3.4.1"
  "onnxruntime==1.32.0" "tokenizers==0.22.2" "numpy==1.26.4" "fastapi==0.165.0" "uvicorn==0.32.1"
)
RAY_PINS=(
  "ray[serve]==2.60.0" "onnxruntime==1.32.0" "tokenizers==0.23.3" "numpy==2.4.6" "starlette==1.10.0"
)

make_venv() {  # make_venv NAME PIN...: .bench/venv-NAME with exactly these pins, unless its stamp matches
  local name=$1; shift
  local venv=$BENCH/venv-$name stamp
  stamp=$(printf '%s\n' "$PYTHON" "$@")
  if [ -f "$venv/.peers-stamp" ] && [ "$(cat "$venv/.peers-stamp")" = "$stamp" ]; then
    say "$name: up to date ($venv)"
    return 0
  fi
  say "$name: building $venv"
  rm -rf "$venv"
  "$PYTHON" -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip >/dev/null
  local torch_pin
  for torch_pin in "$@"; do
    case "$torch_pin" in torch==*) "$venv/bin/pip" install -q "$torch_pin" ;; esac
  done
  "$venv/bin/pip" install -q "$@"
  "$venv/bin/pip" check >&2
  printf '%s' "$stamp" > "$venv/.peers-stamp"
  say "$name: ready"
}

mkdir -p "$BENCH"
peers=("$@")
[ ${#peers[@]} -gt 0 ] || peers=(infinity ray)
for peer in "${peers[@]}"; do
  case "$peer" in
    infinity) make_venv infinity "${INFINITY_PINS[@]}" ;;
    ray) make_venv ray "${RAY_PINS[@]}" ;;
    *) say "unknown peer $peer (expected infinity or ray)"; exit 2 ;;
  esac
done

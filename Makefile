# Two commands for a newcomer: `make serve` and `make test`. Both set everything up first:
# `make serve` what serving and building the example models need, `make test` (and every benchmark)
# the dev tool chain too (scripts/setup.sh --dev).
VENV   := .venv
BIN    := $(VENV)/bin
# The repository `make serve` serves (and `make setup` prepares): your own with MODEL_REPOSITORY=<dir>.
MODEL_REPOSITORY ?= model_repository
PYTEST_ARGS ?=

BENCH_ARGS ?=
PEERS_ARGS ?=
SHIPPED_ARGS ?=
LOAD_ARGS ?=
P99_MS ?= 200
TUNE_ARGS ?=
EVAL_ARGS ?=
TUNE_PROFILE ?= queries
SOAK_S ?= 600
SOAK_ARGS ?=
CAPACITY_ARGS ?=
# Replicas of `make cluster`; CLUSTER_ARGS: more `coalesce cluster` options (--stats-port, --replica-port-base...).
REPLICAS ?= 2
CLUSTER_ARGS ?=

.PHONY: setup setup-dev serve test unit integration lint lock clean bench bench-defaults bench-shared bench-neighbours bench-generate bench-openai bench-bulk eval-adaptive load tune soak flood cluster cluster-test bulk-ray-test capacity vllm-ci-full

setup:                 ## venv with .[serve,export,generate], OS packages, the repository's models, Triton runtime (idempotent)
	@MODEL_REPOSITORY="$(MODEL_REPOSITORY)" bash scripts/setup.sh

setup-dev:             ## setup, plus the test, lint and perf tool chain (.[dev])
	@MODEL_REPOSITORY="$(MODEL_REPOSITORY)" bash scripts/setup.sh --dev

serve: setup           ## start Triton on $(MODEL_REPOSITORY) and the OpenAI gateway beside it (HOST, *_PORT, OPENAI_PORT, MODEL_CONTROL, COALESCE_ADMIN_KEY, COALESCE_API_KEY, GRPC_TLS_*, RESPONSE_CACHE_BYTES, RATE_LIMIT)
	$(BIN)/coalesce serve --model-repository "$(MODEL_REPOSITORY)"

cluster: setup         ## REPLICAS (2) tritonservers on $(MODEL_REPOSITORY), one shared Redis, haproxy in front (HTTP_PORT, GRPC_PORT, HOST; Ctrl-C stops all)
	$(BIN)/coalesce cluster --replicas $(REPLICAS) --model-repository "$(MODEL_REPOSITORY)" $(CLUSTER_ARGS)

bulk-ray-test:         ## a Ray cluster (head + 2 workers, each beside its own tritonserver), 100 000 rows, a worker killed mid-job: every id exactly once; writes perf/results/bulk-ray-test-<date>.md
	@bash scripts/setup.sh --dev
	BULK_RAY_REPORT=perf/results/bulk-ray-test-$$(date -u +%Y%m%d).md $(BIN)/pytest -m slow -s $(PYTEST_ARGS) tests/integration/test_bulk_ray_cluster.py

cluster-test:          ## 2 replicas behind haproxy under traffic, one killed mid-run, a late one warm from Redis; writes perf/results/cluster-<date>.md
	@bash scripts/setup.sh --dev
	CLUSTER_REPORT=perf/results/cluster-$$(date -u +%Y%m%d).md $(BIN)/pytest -m slow -s $(PYTEST_ARGS) tests/integration/test_cluster.py

test: setup-dev lint   ## lint, then unit and integration tests (a real tritonserver)
	$(BIN)/pytest $(PYTEST_ARGS) tests perf/tests

bench:                 ## perf_analyzer: coalesce vs naive side by side, offline ceilings; then perf.peers (PEERS_ARGS): Infinity, Ray Serve; writes perf/results/
	@bash scripts/setup.sh --bench
	$(BIN)/python -m perf.bench $(BENCH_ARGS)
	$(BIN)/python -m perf.peers $(PEERS_ARGS)

bench-defaults:        ## the shipped minilm defaults (INT8, queue delay 0, row cache) against each alternative, then the shipped server (SHIPPED_ARGS); writes perf/results/defaults-*, shipped-*
	@bash scripts/setup.sh --dev
	@bash scripts/setup_peers.sh infinity
	$(BIN)/python -m perf.defaults $(BENCH_ARGS)
	$(BIN)/python -m perf.peers --systems coalesce,coalesce-shipped,coalesce-shipped-int8,coalesce-shipped-fp32,infinity-torch \
		--run shipped-$$(date -u +%Y%m%d) $(SHIPPED_ARGS)

bench-shared:          ## the shared Redis row-cache tier: cost on distinct traffic, a second server starting warm
	@bash scripts/setup.sh --dev
	$(BIN)/python -m perf.shared_cache $(BENCH_ARGS)

bench-openai:          ## the gateway: /v1/embeddings vs gRPC vs Infinity, chat SSE vs a gRPC stream, /v1/rerank; writes perf/results/gateway-*
	@bash scripts/setup.sh --dev
	@bash scripts/setup_peers.sh infinity
	$(BIN)/python -m perf.gateway $(BENCH_ARGS)

bench-generate:        ## smollm2: continuous batching vs static (Triton-batched) vs one at a time at 16 streams, and vs llama.cpp's llama-server (built once under .bench/) at 16 and 1 streams; writes perf/results/generate-*
	@bash scripts/setup.sh --dev
	@bash scripts/setup_peers.sh llama-server >/dev/null
	$(BIN)/python -m perf.generate $(BENCH_ARGS)

bench-bulk:            ## coalesce-client batch through one server vs the offline limit, and $/1M rows vs online c=16; writes perf/results/bulk-*
	@bash scripts/setup.sh --dev
	$(BIN)/python -m perf.bulk $(BENCH_ARGS)

bench-neighbours:      ## one model at 2x capacity beside light ones, by isolation variant; writes perf/results/neighbours-*
	@bash scripts/setup.sh --dev
	$(BIN)/python -m perf.neighbours $(BENCH_ARGS)

eval-adaptive:         ## adaptive scheduling vs the best static config coalesce tune finds for the same p99 (EVAL_ARGS); writes perf/results/adaptive-*
	@bash scripts/setup.sh --dev
	$(BIN)/python -m perf.adaptive $(EVAL_ARGS)

soak:                  ## SOAK_S seconds (600) of mixed load, bad inputs, Redis restarted twice, a stub killed; writes perf/results/soak-*
	@bash scripts/setup.sh --dev
	$(BIN)/python -m perf.soak --duration-s $(SOAK_S) $(SOAK_ARGS)

vllm-ci-full:          ## the vLLM backend's additional-outputs test, all 1458 cases, on smollm2; writes perf/results/vllm-ci-<date>.md
	@bash scripts/setup.sh --dev
	VLLM_CI_REPORT=perf/results/vllm-ci-$$(date -u +%Y%m%d).md $(BIN)/pytest -m slow $(PYTEST_ARGS) \
	  tests/integration/test_vllm_backend_ci.py::test_additional_outputs_every_case

flood:                 ## 64 threads of 1 MiB rows at minilm for FLOOD_SECONDS (60): RSS bounded, canaries answered; writes perf/results/flood-<date>.md
	@bash scripts/setup.sh --dev
	FLOOD_REPORT=perf/results/flood-$$(date -u +%Y%m%d).md $(BIN)/pytest -m slow -s $(PYTEST_ARGS) tests/integration/test_flood.py

capacity:              ## replicas for a load and p99 on paper, from committed results (CAPACITY_ARGS: --rows-per-s, --p99-ms, --repeat-rates); writes perf/results/capacity-*
	@bash scripts/setup.sh --dev
	$(BIN)/python -m perf.capacity $(CAPACITY_ARGS)

load:                  ## Locust, headless: steady/poisson/burst/ramp over gRPC and HTTP; writes perf/results/load-*
	@bash scripts/setup.sh --dev
	$(BIN)/python -m perf.load $(LOAD_ARGS)

tune:                  ## coalesce tune --p99-ms $(P99_MS) on a seeded workload; writes perf/results/tune-*
	@bash scripts/setup.sh --dev
	$(BIN)/python -m perf.workloads --profile $(TUNE_PROFILE) --count 3000 --out .triton/tune-$(TUNE_PROFILE).json
	$(BIN)/coalesce tune --p99-ms $(P99_MS) --input-data .triton/tune-$(TUNE_PROFILE).json $(TUNE_ARGS)

unit: setup-dev
	$(BIN)/pytest $(PYTEST_ARGS) tests/unit perf/tests

integration: setup-dev
	$(BIN)/pytest $(PYTEST_ARGS) tests/integration

lint: setup-dev        ## ruff (style, docstrings) and mypy
	$(BIN)/ruff check backends client tests scripts perf
	$(BIN)/mypy

# Current pins are kept and packages new to the extras are added; UPGRADE=1 re-resolves every one.
# torch: its CPU index where reachable (as scripts/setup.sh), else the configured indexes.
lock:                  ## re-pin requirements/constraints.txt from a fresh venv (UPGRADE=1: newest of everything)
	rm -rf /tmp/coalesce-lock && python3 -m venv /tmp/coalesce-lock
	/tmp/coalesce-lock/bin/pip install -q -U "pip>=24"
	/tmp/coalesce-lock/bin/pip install -q -e ".[dev]" $(if $(UPGRADE),,-c requirements/constraints.txt) \
	  $$(curl -fsS --max-time 3 -o /dev/null https://download.pytorch.org/whl/cpu/torch/ 2>/dev/null \
	     && echo --extra-index-url https://download.pytorch.org/whl/cpu)
	{ echo "# Pinned versions of every package the project installs (pip constraints)."; \
	  echo "# Regenerate: make lock.  torch is the local CPU build (2.13.0+cpu satisfies ==2.13.0)."; \
	  /tmp/coalesce-lock/bin/pip freeze --exclude-editable | grep -v '^-e' | sed 's/^torch==\(.*\)+cpu/torch==\1/'; \
	} > requirements/constraints.txt

clean:
	rm -rf $(VENV) model_repository/*/[0-9]*/model.onnx model_repository/*/[0-9]*/model.int8.onnx* model_repository/*/[0-9]*/tokenizer.json \
	  model_repository/*/[0-9]*/export.json model_repository/*/[0-9]*/hf model_repository/*/[0-9]*/model.plan* \
	  model_repository/*/[0-9]*/*.tmp tests/models/*/[0-9]*

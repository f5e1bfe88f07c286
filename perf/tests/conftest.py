"""Fixtures of the perf tooling tests: the example models `make setup` builds (as in tests/conftest.py)."""

from pathlib import Path

import pytest

from tests.conftest import built


@pytest.fixture(scope="session")
def version_dir() -> Path:
    return built("minilm")

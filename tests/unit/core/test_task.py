"""A file a setting names is found in the model's version folder, never outside it."""

from pathlib import Path

import pytest

from coalesce.core.errors import ConfigError
from coalesce.core.task import version_file


def test_version_file_joins_relative_names():
    assert version_file(Path("/repo/m/1"), "hf") == Path("/repo/m/1/hf")
    assert version_file(Path("/repo/m/1"), "sub/model.onnx") == Path("/repo/m/1/sub/model.onnx")


@pytest.mark.parametrize("name", ["/etc/passwd", "../2/model.onnx", "a/../../b"])
def test_version_file_refuses_names_that_leave_the_folder(name):
    with pytest.raises(ConfigError, match=f"file '{name}': must"):
        version_file(Path("/repo/m/1"), name)

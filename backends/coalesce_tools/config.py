"""Reading a model repository's ``config.pbtxt`` files as Triton does (protobuf text format), into the JSON form."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any


class ConfigReadError(ValueError):
    """A ``config.pbtxt`` is not valid protobuf text for Triton's ``ModelConfig``."""


def read_model_config(path: Path) -> dict[str, Any]:
    """``config.pbtxt`` at ``path`` as the JSON form Triton hands a backend (field names as in the proto).

    Raises:
        ConfigReadError: Naming the file and the parse error.
    """
    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2

    try:
        message = text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())
    except text_format.ParseError as exc:
        raise ConfigReadError(f"{path}: {exc}") from None
    return json_format.MessageToDict(message, preserving_proto_field_name=True)


def coalesce_models(repository: Path) -> Iterator[tuple[Path, dict[str, Any]]]:
    """Every model folder of ``repository`` whose config names ``backend: "coalesce"``, with its config."""
    for config_path in sorted(repository.glob("*/config.pbtxt")):
        config = read_model_config(config_path)
        if config.get("backend") == "coalesce":
            yield config_path.parent, config


def parameter(config: dict[str, Any], key: str, default: str = "") -> str:
    """One ``parameters`` value of a config (JSON form), as a string."""
    value = (config.get("parameters") or {}).get(key)
    return str(value.get("string_value", default)) if isinstance(value, dict) else default


def version_dirs(model_dir: Path) -> list[Path]:
    """The model's numbered version folders (``1/`` for a fresh clone that has none yet)."""
    found = sorted((p for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))
    return found or [model_dir / "1"]


def with_parameters(config: dict[str, Any], **parameters: str) -> dict[str, Any]:
    """A copy of ``config`` (JSON form) with ``parameters`` set (as Triton stores them: string values)."""
    out = dict(config)
    out["parameters"] = {**(config.get("parameters") or {}),
                         **{key: {"string_value": str(value)} for key, value in parameters.items()}}
    return out

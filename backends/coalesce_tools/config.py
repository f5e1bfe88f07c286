"""Reading a model repository's ``config.pbtxt`` files as Triton does (protobuf text format), into the JSON form."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, overload


class ConfigReadError(ValueError):
    """A ``config.pbtxt`` is not valid protobuf text for Triton's ``ModelConfig``."""


def read_model_config(path: Path) -> dict[str, Any]:
    """``config.pbtxt`` at ``path`` as the JSON form Triton hands a backend (field names as in the proto).

    Raises:
        ConfigReadError: Naming the file and the parse error.
    """
    return parse_model_config(path.read_text(), where=str(path))


def parse_model_config(text: str, where: str = "config.pbtxt") -> dict[str, Any]:
    """The text of a ``config.pbtxt`` as the JSON form (``where`` names it in errors).

    Raises:
        ConfigReadError: Naming ``where`` and the parse error.
    """
    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2

    try:
        message = text_format.Parse(text, model_config_pb2.ModelConfig())
    except text_format.ParseError as exc:
        raise ConfigReadError(f"{where}: {exc}") from None
    return json_format.MessageToDict(message, preserving_proto_field_name=True)


def model_config_text(config: dict[str, Any]) -> str:
    """A config in JSON form as ``config.pbtxt`` text (protobuf text format)."""
    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2

    return text_format.MessageToString(json_format.ParseDict(config, model_config_pb2.ModelConfig()))


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


@overload
def with_parameters(config: str, parameters: Mapping[str, str]) -> str: ...
@overload
def with_parameters(config: dict[str, Any], parameters: Mapping[str, str]) -> dict[str, Any]: ...
def with_parameters(config: str | dict[str, Any], parameters: Mapping[str, str]) -> str | dict[str, Any]:
    """A copy of ``config`` with ``parameters`` set (replacing the same keys, else added) as string values.

    ``config`` is the JSON form (as ``read_model_config`` gives it) or ``config.pbtxt`` text.
    Text is edited in place, its comments and layout kept (a tuned config stays the user's
    file), then parsed to check that every value took.

    Raises:
        ConfigReadError: If ``config`` is text that does not parse, or that this edit cannot
            set a parameter in (a ``parameters { ... }`` block that already holds the key).
    """
    if not isinstance(config, str):
        out = dict(config)
        out["parameters"] = {**(config.get("parameters") or {}),
                             **{key: {"string_value": str(value)} for key, value in parameters.items()}}
        return out
    text = config
    for key, value in parameters.items():
        text = _set_parameter_text(text, key, str(value))
    if parameters:
        got = parse_model_config(text)
        wrong = {key: parameter(got, key) for key, value in parameters.items() if parameter(got, key) != str(value)}
        if wrong:
            raise ConfigReadError(f"could not set parameters {sorted(wrong)} in this config.pbtxt text (they read "
                                  f"{wrong}); write them as entries of one 'parameters [ ... ]' list")
    return text


def _set_parameter_text(text: str, key: str, value: str) -> str:
    entry = re.compile(r'(\{\s*key:\s*"' + re.escape(key) + r'"\s*,\s*value:\s*\{\s*string_value:\s*")[^"]*(")')
    if entry.search(text):
        return entry.sub(lambda m: m.group(1) + value + m.group(2), text, count=1)
    line = f'  {{ key: "{key}", value: {{ string_value: "{value}" }} }}'
    block = re.compile(r"(parameters\s*\[)(.*?)(\n\])", re.S)
    if block.search(text):
        return block.sub(lambda m: m.group(1) + m.group(2).rstrip() + ",\n" + line + m.group(3), text, count=1)
    return text.rstrip() + f"\n\nparameters [\n{line}\n]\n"

"""Model repositories for the perf lab: configs written, the shipped weights linked (never copied)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: The shipped model, whose version folder every perf-lab model links.
MINILM = ROOT / "model_repository" / "minilm"


def add_model(repository: Path, name: str, config: str, *, version_dir: Path = MINILM / "1") -> Path:
    """Write ``repository/name/config.pbtxt`` and link the ONNX graph and tokenizer of ``version_dir``."""
    target = repository / name / "1"
    target.mkdir(parents=True)
    (repository / name / "config.pbtxt").write_text(config)
    for item in ("model.onnx", "tokenizer.json"):
        (target / item).symlink_to((version_dir / item).resolve())
    return repository / name


def renamed(config: str, name: str) -> str:
    """The shipped minilm config under another model name."""
    return config.replace('name: "minilm"', f'name: "{name}"')

"""Model repositories for the perf lab: configs written, the shipped weights linked (never copied)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Final

ROOT = Path(__file__).resolve().parent.parent
#: The shipped model, whose version folder every perf-lab model links.
MINILM = ROOT / "model_repository" / "minilm"


def add_model(repository: Path, name: str, config: str, *, version_dir: Path = MINILM / "1") -> Path:
    """Write ``repository/name/config.pbtxt`` and link every regular file of ``version_dir`` into its version 1.

    Every file, not a fixed list: a variant file the config may select (an INT8 graph beside
    ``model.onnx``, a TensorRT plan) is then there as in the shipped folder. Folders (``hf/``)
    are left out: the perf lab's models run the ONNX graph.
    """
    target = repository / name / "1"
    target.mkdir(parents=True)
    (repository / name / "config.pbtxt").write_text(config)
    for item in sorted(version_dir.iterdir()):
        if item.is_file():
            (target / item.name).symlink_to(item.resolve())
    return repository / name


#: ONNX Runtime on every core, spinning (its defaults): how a server that runs one model alone is set up.
#: The example repository gives each model one thread, for four models sharing two cores
#: (perf/results/neighbours-*); the single-model benchmarks measure one model at a time.
SINGLE_MODEL_THREADS: Final = {"intra_op_threads": "0", "thread_spinning": "true"}


def with_parameters(config: str, parameters: dict[str, str]) -> str:
    """``config`` text with ``parameters`` set (replacing the same keys, else added)."""
    for key, value in parameters.items():
        entry = f'{{ key: "{key}", value: {{ string_value: "{value}" }} }}'
        config, count = re.subn(r'\{ key: "' + re.escape(key) + r'", value: \{ string_value: "[^"]*" \} \}', entry,
                                config)
        if not count:
            config = config.replace("parameters [", f"parameters [\n  {entry},", 1)
    return config


def single_model_config() -> str:
    """The shipped ``minilm`` config as a server running it alone would have it (``SINGLE_MODEL_THREADS``)."""
    return with_parameters((MINILM / "config.pbtxt").read_text(), SINGLE_MODEL_THREADS)


def renamed(config: str, name: str) -> str:
    """The shipped minilm config under another model name."""
    return config.replace('name: "minilm"', f'name: "{name}"')

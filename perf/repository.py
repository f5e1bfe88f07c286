"""Model repositories for the perf lab: configs written, the shipped weights linked (never copied)."""

from __future__ import annotations

import re
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Final

from coalesce_tools.config import with_parameters
from coalesce_tools.launcher import ServerOptions, TritonServer

ROOT = Path(__file__).resolve().parent.parent
#: The line of a config's dynamic_batching that sets Triton's queue delay.
QUEUE_DELAY_LINE: Final = re.compile(r"max_queue_delay_microseconds: \d+\n")
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


#: The shipped example repository: every example model, as ``make serve`` serves it.
EXAMPLES: Final = ROOT / "model_repository"


def example_repository(dest: Path, configure: Callable[[str, str], str] = lambda name, config: config) -> Path:
    """Every example model under ``dest``, build outputs (files and folders of its version 1) linked.

    Each config is what ``configure(name, shipped text)`` returns.
    """
    for model_dir in sorted(p for p in EXAMPLES.iterdir() if (p / "config.pbtxt").is_file()):
        target = dest / model_dir.name / "1"
        target.mkdir(parents=True)
        (dest / model_dir.name / "config.pbtxt").write_text(
            configure(model_dir.name, (model_dir / "config.pbtxt").read_text()))
        for item in (model_dir / "1").iterdir():
            (target / item.name).symlink_to(item.resolve())
    return dest


#: ONNX Runtime on every core, spinning (its defaults): how a server that runs one model alone is set up.
#: The example repository gives each model one thread, for four models sharing two cores
#: (perf/results/neighbours-*); the single-model benchmarks measure one model at a time.
SINGLE_MODEL_THREADS: Final = {"intra_op_threads": "0", "thread_spinning": "true"}
#: The row cache off: for measuring compute, or serving traffic that cycles through a workload's texts
#: (a cache would answer repeats that all-distinct traffic does not have).
NO_CACHE: Final = {"cache_bytes": "0"}


def single_model_config() -> str:
    """The shipped ``minilm`` config as a server running it alone would have it (``SINGLE_MODEL_THREADS``)."""
    return with_parameters((MINILM / "config.pbtxt").read_text(), SINGLE_MODEL_THREADS)


def with_queue_delay(config: str, delay_us: int) -> str:
    """``config`` with its ``max_queue_delay_microseconds`` set to ``delay_us``.

    Raises:
        ValueError: If the text does not set the delay exactly once.
    """
    changed, count = QUEUE_DELAY_LINE.subn(f"max_queue_delay_microseconds: {delay_us}\n", config)
    if count != 1:
        raise ValueError("the config does not set max_queue_delay_microseconds exactly once")
    return changed


def renamed(config: str, name: str) -> str:
    """The shipped minilm config under another model name."""
    return config.replace('name: "minilm"', f'name: "{name}"')


def reload_model(grpc_url: str, model: str, timeout_s: float = 120.0) -> None:
    """Unload ``model`` and load it again: a fresh instance, its row cache empty.

    A plain load request is not enough: Triton leaves a loaded model whose files did not
    change as it is (measured: the cache kept the previous point's vectors and answered a
    third to four fifths of the next point's texts).

    Raises:
        TimeoutError: If the model is still ready ``timeout_s`` after the unload request.
    """
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(grpc_url)
    try:
        client.unload_model(model)
        deadline = time.monotonic() + timeout_s
        while client.is_model_ready(model):  # the unload finishes after the request returns
            if time.monotonic() > deadline:
                raise TimeoutError(f"{model} still ready {timeout_s:.0f} s after its unload request")
            time.sleep(0.1)
        client.load_model(model)
    finally:
        client.close()


def serve(configs: Mapping[str, str], prefix: str = "coalesce-perf-") -> TritonServer:
    """A tritonserver, not yet started, on a new repository holding ``configs`` (model name to config text).

    Each config is renamed to its model name and linked to the shipped weights; all are loaded
    at start; ports are free ones on 127.0.0.1.
    """
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    for name, config in configs.items():
        add_model(folder, name, renamed(config, name))
    return TritonServer(ServerOptions.on_free_ports(folder, model_control="explicit", load_models=tuple(configs)))

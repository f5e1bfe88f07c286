"""The container's install without Docker: the wheel of ``pip install .`` serving every example model.

The Dockerfile installs the project with ``pip install .`` (a wheel), copies
``backends/coalesce/model.py`` and ``backends/coalesce/coalesce`` into Triton's backend
folder and runs ``coalesce serve``. ``make setup`` makes an editable install instead, which
maps whole source folders and so hides a package the wheel leaves out (``coalesce.generation``
once was: every model then failed to load in the container, since ``model.py`` imports it,
and nothing here noticed). This test repeats the container's steps on this machine:

1. It builds the wheel from a copy of exactly what the Dockerfile copies in
   (``pyproject.toml``, ``README.md``, ``backends/``, ``client/``), offline, and checks that
   it holds every module of the backend folder and no test or perf package.
2. It installs the wheel into a fresh virtual environment with ``--no-deps``, so the code
   under test is the wheel's and nothing of the checkout. Installing the dependencies anew
   (torch among them) would take minutes and the network; instead a path line in a ``.pth``
   file of the fresh venv puts an environment that has them after its own site-packages.
   Python does not process the ``.pth`` files of a folder added that way, so that
   environment's editable install of this project stays off: the test checks that
   ``coalesce``, ``coalesce_tools`` and ``coalesce_client`` come from the fresh venv, that
   every module of theirs imports with that Python, and that every ``Requires-Dist`` of the
   wheel (its own and those of the extras the served models need) is met by an installed
   distribution, so no dependency the wheel declares is missing or of a version it refuses.
3. It lays out a Triton root as the container's ``/opt/tritonserver`` (the server of the
   ``nvidia-pytriton`` wheel, the Python backend with the stub for the Python under test, and
   ``backends/coalesce`` copied as the Dockerfile does) and starts the fresh venv's
   ``coalesce serve`` on it with ``TRITONSERVER_ROOT``: the launcher then takes the installed
   backend folder, as in the container, and puts the fresh venv's Python first on ``PATH`` for
   the stubs, which the test checks on the running stubs (their ``PATH`` and libpython).
4. It serves every example model of the repository and runs one real inference on each.

Which copy the stubs import: Triton appends ``<backend-dir>/coalesce`` to the stub's
``sys.path``, after site-packages, so ``import coalesce`` finds the installed wheel's package
and the copied folder only serves ``model.py`` (seen here: a marker in each copy's
``__init__.py`` was written only by the wheel's, in the tools and in every stub). A package the
wheel lacks therefore fails every model's load (seen: ``No module named 'coalesce.generation'``
for each model, with a complete folder beside it); the test also checks that the folder holds
nothing the wheel lacks.

Each Python the project supports and this machine has runs it: the project's venv (3.11), and
3.10, the Python of the Triton 24.10 container the Dockerfile builds on (Ubuntu 22.04), from
``.venv/py3.10`` which ``make setup-dev`` fills with the backend's serving dependencies where a
``python3.10`` exists. 3.10 serves the ONNX models; ``smollm2`` needs torch, whose PyPI build is
GBs of CUDA wheels, so only the project's venv serves it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

import numpy as np
import pytest
from packaging.requirements import Requirement

from coalesce_tools.launcher import free_port
from coalesce_tools.processes import programs_under
from tests.conftest import EXAMPLE_MODELS, GENERATE_MODELS, REPOSITORY, ROOT, built
from tests.integration.conftest import add_model

pytestmark = pytest.mark.integration

#: What the Dockerfile copies into the image before ``pip install .``.
DOCKER_CONTEXT = ("pyproject.toml", "README.md", "backends", "client")
#: The packages the wheel holds: the backend, the developer tools, the client.
PACKAGES = {"coalesce", "coalesce_tools", "coalesce_client"}
#: The environment ``make setup-dev`` fills for Python 3.10 (see the module docstring).
PY310_ENV = ROOT / ".venv" / "py3.10"
READY_TIMEOUT_S = 240.0

#: Run in the fresh venv: where our packages come from, whether every module of them imports (a module that
#: needs a package this environment lacks, e.g. torch under 3.10, is reported as such), which distributions
#: are installed, and what the wheel requires.
PROBE = """
import importlib, importlib.metadata as md, importlib.util, json, pkgutil, sys, sysconfig
modules, failed, lacking = {}, {}, {}
for top in ("coalesce", "coalesce_tools", "coalesce_client"):
    package = importlib.import_module(top)
    modules[top] = package.__file__
    for info in pkgutil.walk_packages(package.__path__, top + "."):
        try:
            importlib.import_module(info.name)
        except ModuleNotFoundError as exc:
            missing = (exc.name or "").split(".")[0]
            if missing and missing not in modules and importlib.util.find_spec(missing) is None:
                lacking[info.name] = missing
            else:
                failed[info.name] = repr(exc)
        except Exception as exc:
            failed[info.name] = repr(exc)
ours = md.distribution("coalesce")
installed = {}
for dist in md.distributions():
    installed.setdefault(dist.metadata["Name"].lower().replace("_", "-"), dist.version)
print(json.dumps({"modules": modules, "failed": failed, "lacking": lacking, "requires": ours.requires or [],
                  "metadata_at": str(ours.locate_file("")), "installed": installed,
                  "python": ".".join(map(str, sys.version_info[:3])), "libdir": sysconfig.get_config_var("LIBDIR"),
                  "purelib": sysconfig.get_paths()["purelib"]}))
"""


@dataclasses.dataclass(frozen=True)
class Target:
    """A Python to install the wheel for: its interpreter, where its dependencies are, what it serves."""

    interpreter: Path
    #: site-packages of an environment that holds the third-party dependencies.
    dependencies: Path
    #: Extras whose requirements must be met (besides the wheel's own).
    extras: tuple[str, ...]
    models: tuple[str, ...]
    #: Third-party packages the environment may lack: the modules of the wheel that import them are not imported.
    may_lack: frozenset[str] = frozenset()


def _site_packages(python: Path) -> Path:
    out = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True)
    return Path(out.stdout.strip())


def _target(name: str) -> Target:
    if name == "venv":
        # The project's venv: every extra serving uses, and the generate model.
        return Target(interpreter=Path(sys.executable), dependencies=Path(sysconfig.get_paths()["purelib"]),
                      extras=("client", "redis", "serve", "generate"), models=(*EXAMPLE_MODELS, *GENERATE_MODELS))
    python = PY310_ENV / "bin" / "python"
    if not (PY310_ENV / ".coalesce-stamp").is_file():
        pytest.skip(f"no {PY310_ENV}: `make setup-dev` makes it where a python3.10 with a shared libpython exists")
    # The container's install is .[client,redis,gateway,gpu]; the gpu extra (onnxruntime-gpu, tensorrt, torch) needs
    # a GPU.
    return Target(interpreter=python, dependencies=_site_packages(python), extras=("client", "redis", "gateway"),
                  models=EXAMPLE_MODELS, may_lack=frozenset({"torch", "pyarrow"}))


@dataclasses.dataclass(frozen=True)
class Build:
    """The wheel, and the copy of the Dockerfile's build context it was built from."""

    wheel: Path
    context: Path

    def modules(self, package: str) -> set[str]:
        """The wheel's ``.py`` files of ``package``, as ``package/...`` paths."""
        return {n for n in zipfile.ZipFile(self.wheel).namelist() if n.startswith(package + "/") and n.endswith(".py")}


def _py_files(folder: Path, package: str) -> set[str]:
    return {f"{package}/{p.relative_to(folder).as_posix()}" for p in folder.rglob("*.py")}


@pytest.fixture(scope="module")
def build(tmp_path_factory) -> Build:
    """The wheel ``pip install .`` builds in the container, from a copy of the Dockerfile's build context."""
    base = tmp_path_factory.mktemp("wheel")
    context = base / "context"
    context.mkdir()
    junk = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")
    for name in DOCKER_CONTEXT:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, context / name, ignore=junk)
        else:
            shutil.copy2(source, context / name)
    # No build isolation: setuptools from this venv, so no network is needed.
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                             "--disable-pip-version-check", "-q", "-w", str(base / "dist"), str(context)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"pip wheel failed:\n{result.stdout}\n{result.stderr}"
    (wheel,) = (base / "dist").glob("coalesce-*.whl")
    return Build(wheel=wheel, context=context)


def test_wheel_holds_every_module_of_the_backend_tools_and_client(build):
    names = zipfile.ZipFile(build.wheel).namelist()
    tops = {name.split("/", 1)[0] for name in names if not name.split("/", 1)[0].endswith(".dist-info")}
    assert tops == PACKAGES, "the wheel's top-level packages (no tests, perf or scripts)"
    for package, folder in (("coalesce", ROOT / "backends" / "coalesce" / "coalesce"),
                            ("coalesce_tools", ROOT / "backends" / "coalesce_tools"),
                            ("coalesce_client", ROOT / "client" / "coalesce_client")):
        source, in_wheel = _py_files(folder, package), build.modules(package)
        assert in_wheel == source, (f"{package}: missing from the wheel {sorted(source - in_wheel)}, "
                                    f"not in the source {sorted(in_wheel - source)}")


def _install(target: Target, build: Build, dest: Path) -> tuple[Path, dict]:
    """A fresh venv at ``dest`` with the wheel alone; the dependencies behind it on ``sys.path``. Its probe's facts."""
    subprocess.run([str(target.interpreter), "-m", "venv", "--without-pip", str(dest)], check=True, timeout=120)
    python = dest / "bin" / "python"
    result = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
                             "--no-index", "--disable-pip-version-check", "-q", str(build.wheel)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"pip install failed:\n{result.stdout}\n{result.stderr}"
    (_site_packages(python) / "_coalesce_test_dependencies.pth").write_text(f"{target.dependencies}\n")
    probe = subprocess.run([str(python), "-c", PROBE], capture_output=True, text=True, env=_environment(),
                           cwd=dest, timeout=300)
    assert probe.returncode == 0, probe.stderr
    return python, json.loads(probe.stdout)


def _environment() -> dict[str, str]:
    # Nothing of this process's Python may leak into the fresh venv's.
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}


def _unmet(facts: dict, extras: tuple[str, ...]) -> list[str]:
    """The wheel's requirements (its own and ``extras``') that no installed distribution satisfies."""
    environment = {"python_version": facts["python"].rsplit(".", 1)[0], "python_full_version": facts["python"]}
    unmet = []
    for line in facts["requires"]:
        requirement = Requirement(line)
        if requirement.marker and not any(requirement.marker.evaluate({**environment, "extra": extra})
                                          for extra in ("", *extras)):
            continue
        have = facts["installed"].get(requirement.name.lower().replace("_", "-"))
        if have is None or not requirement.specifier.contains(have, prereleases=True):
            unmet.append(f"{line} (installed: {have})")
    return unmet


def _container_root(dest: Path, context: Path, python_tag: str) -> Path:
    """A Triton root laid out as the container's ``/opt/tritonserver``, the Dockerfile's backend folder in it."""
    import pytriton

    wheel_root = Path(pytriton.__file__).resolve().parent / "tritonserver"
    (dest / "bin").mkdir(parents=True)
    (dest / "bin" / "tritonserver").symlink_to(wheel_root / "bin" / "tritonserver")
    (dest / "lib").symlink_to(wheel_root.parent.parent / "nvidia_pytriton.libs", target_is_directory=True)
    (dest / "caches").symlink_to(wheel_root / "caches", target_is_directory=True)
    python_dir = dest / "backends" / "python"
    python_dir.mkdir(parents=True)
    for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
        shutil.copy2(wheel_root / "backends" / "python" / name, python_dir / name)
    stub = wheel_root / "python_backend_stubs" / python_tag / "triton_python_backend_stub"
    assert stub.is_file(), f"the nvidia-pytriton wheel has no stub for Python {python_tag}"
    # A container's stub sits in backends/python, built for the container's Python.
    shutil.copy2(stub, python_dir / "triton_python_backend_stub")
    # The Dockerfile's RUN step: cp backends/coalesce/model.py, cp -r backends/coalesce/coalesce.
    ours = dest / "backends" / "coalesce"
    ours.mkdir()
    shutil.copy2(context / "backends" / "coalesce" / "model.py", ours / "model.py")
    shutil.copytree(context / "backends" / "coalesce" / "coalesce", ours / "coalesce")
    return dest


def _get(url: str, body: dict | None = None) -> tuple[int, str]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data, headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError as exc:
        return 0, str(exc)


class Serve:
    """The fresh venv's ``coalesce serve`` on a repository, with ``TRITONSERVER_ROOT`` set: the container's command."""

    def __init__(self, venv: Path, root: Path, repository: Path, log: Path) -> None:
        self.ports = {name: free_port() for name in ("HTTP_PORT", "GRPC_PORT", "METRICS_PORT", "HEALTH_PORT")}
        self.http = f"127.0.0.1:{self.ports['HTTP_PORT']}"
        self.grpc = f"127.0.0.1:{self.ports['GRPC_PORT']}"
        self.log = log
        env = {**_environment(), **{k: str(v) for k, v in self.ports.items()}, "TRITONSERVER_ROOT": str(root),
               "HOST": "127.0.0.1", "MODEL_CONTROL": "none"}
        with log.open("w") as out:
            self.process = subprocess.Popen([str(venv / "bin" / "coalesce"), "serve", "--model-repository",
                                             str(repository)], env=env, stdout=out, stderr=subprocess.STDOUT,
                                            cwd=log.parent)

    def log_tail(self) -> str:
        """The last lines of its log (the launcher's and Triton's)."""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-60:])

    def wait_ready(self, timeout_s: float) -> None:
        """Poll Triton's readiness while the process lives."""
        deadline = time.monotonic() + timeout_s
        while _get(f"http://{self.http}/v2/health/ready")[0] != 200:
            assert self.process.poll() is None, f"coalesce serve exited with {self.process.returncode}"
            assert time.monotonic() < deadline, f"not ready in {timeout_s:.0f} s"
            time.sleep(0.5)

    def stop(self) -> int:
        """SIGTERM (it drains, then stops Triton), then a kill after 60 s; its exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()  # its tritonserver follows (the launcher gives it a parent-death signal)
                self.process.wait(timeout=10)
        return self.process.returncode


def _check_stubs(root: Path, venv: Path, libpython: str) -> None:
    """The stubs run the Python under test: the fresh venv first on their ``PATH``, its libpython loaded."""
    stubs = programs_under(root / "backends" / "python")
    assert stubs, f"no stub process under {root}"
    for pid in stubs:
        raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
        environ = dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)
        assert environ["PATH"].split(os.pathsep)[0] == str(venv / "bin"), environ["PATH"]
        assert libpython in Path(f"/proc/{pid}/maps").read_text(), f"stub {pid} did not load {libpython}"


def _check_models(server: Serve, models: tuple[str, ...]) -> None:
    """One real inference on each model, checked against ONNX Runtime run here where the model is a graph."""
    import onnxruntime as ort
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.grpc)

    def infer(model: str, inputs: dict[str, np.ndarray], dtype: str, output: str) -> np.ndarray:
        items = []
        for name, array in inputs.items():
            item = grpcclient.InferInput(name, list(array.shape), dtype)
            item.set_data_from_numpy(array)
            items.append(item)
        result = client.infer(model, items).as_numpy(output)
        assert result is not None, f"{model}: no {output}"
        return result

    def onnx(model: str, feeds: dict[str, np.ndarray]) -> np.ndarray:
        session = ort.InferenceSession(str(built(model) / "model.onnx"), providers=["CPUExecutionProvider"])
        return session.run(None, feeds)[0]

    try:
        texts = np.array([[b"Coalesce turns dynamic batches into few forward passes."], [b"A cat sat on the mat."]],
                         dtype=object)
        if "minilm" in models:
            vectors = infer("minilm", {"TEXT": texts}, "BYTES", "EMBEDDING")
            assert vectors.shape == (2, 384) and np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-3)
        if "minilm_rerank" in models:
            pairs = np.array([[b"A feline rested on a rug."]] * 2, dtype=object)
            scores = infer("minilm_rerank", {"TEXT": texts, "TEXT_PAIR": pairs}, "BYTES", "SCORES")
            # Cosines of the two texts' embeddings: the cat on the mat is nearer the feline on a rug.
            assert scores.shape == (2, 1) and (np.abs(scores) <= 1).all() and scores[1, 0] > scores[0, 0] + 0.2
        if "minilm_tokens" in models:
            ids = np.array([[101, 7592, 2088, 102]], dtype=np.int64)  # [CLS] hello world [SEP]
            feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}
            states = infer("minilm_tokens", feeds, "INT64", "last_hidden_state")
            np.testing.assert_allclose(states, onnx("minilm_tokens", feeds), atol=1e-4)
        if "digits" in models:
            image = np.random.default_rng(0).random((2, 8, 8), dtype=np.float32) * 16
            logits = infer("digits", {"image": image}, "FP32", "logits")
            np.testing.assert_allclose(logits, onnx("digits", {"image": image}), atol=1e-4)
        for model in set(GENERATE_MODELS) & set(models):
            prompt = "The capital of France is"
            status, body = _get(f"http://{server.http}/v2/models/{model}/generate",
                                {"text_input": prompt, "parameters": {"max_tokens": 4, "temperature": 0}})
            assert status == 200, f"{model}: {body}"
            text = json.loads(body)["text_output"]
            assert text.startswith(prompt) and "Paris" in text[len(prompt):], text
    finally:
        client.close()


@pytest.mark.parametrize("name", ["venv", "py3.10"])
def test_installed_wheel_serves_every_example_model(name, build, tmp_path):
    target = _target(name)
    for model in target.models:
        built(model)

    # 2. The wheel alone in a fresh venv: our packages from it, every module importing, every requirement met.
    venv = tmp_path / "venv"
    _, facts = _install(target, build, venv)
    purelib = Path(facts["purelib"])
    for module, path in facts["modules"].items():
        assert Path(path).is_relative_to(purelib), f"{module} imported from {path}, not the fresh venv"
    assert Path(facts["metadata_at"]) == purelib, "the coalesce distribution found is not the fresh venv's"
    assert not facts["failed"], f"modules of the wheel that fail to import under {facts['python']}: {facts['failed']}"
    assert set(facts["lacking"].values()) <= target.may_lack, f"dependencies missing: {facts['lacking']}"
    unmet = _unmet(facts, target.extras)
    assert not unmet, f"Python {facts['python']}: requirements of the wheel not met: {unmet}"

    # 3. The container's Triton root with the Dockerfile's backend folder, every module of which the wheel holds.
    tag = facts["python"].rsplit(".", 1)[0]
    root = _container_root(tmp_path / "tritonserver", build.context, tag)
    folder = _py_files(root / "backends" / "coalesce" / "coalesce", "coalesce")
    missing = folder - build.modules("coalesce")
    assert not missing, f"modules of the backend folder missing from the wheel: {sorted(missing)}"

    # 4. Every example model served by the fresh venv's `coalesce serve`, one real inference each.
    repository = tmp_path / "models"
    for model in target.models:
        add_model(repository, model, source=REPOSITORY / model)
    server = Serve(venv, root, repository, tmp_path / "serve.log")
    try:
        server.wait_ready(READY_TIMEOUT_S)
        for model in target.models:
            assert _get(f"http://{server.http}/v2/models/{model}/ready")[0] == 200, f"{model} not ready"
        _check_stubs(root, venv, f"{facts['libdir']}/libpython{tag}.so")
        _check_models(server, target.models)
    except Exception as exc:
        server.stop()
        raise AssertionError(f"{exc}\ncoalesce serve log (tail):\n{server.log_tail()}") from exc
    code = server.stop()
    assert code == 0, f"coalesce serve stopped with {code}:\n{server.log_tail()}"

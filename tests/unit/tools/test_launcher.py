"""The launcher: options from the environment, the server's command line and the backend directory it assembles."""

from pathlib import Path

import pytest

from coalesce_tools.launcher import LaunchError, TritonServer, assemble_backend_dir, find_triton, options_from_env


def test_options_from_env(monkeypatch):
    monkeypatch.setenv("HTTP_PORT", "9000")
    monkeypatch.setenv("GRPC_PORT", "9001")
    monkeypatch.setenv("METRICS_PORT", "9002")
    monkeypatch.setenv("MODEL_CONTROL", "explicit")
    options = options_from_env(Path("repo"))
    assert (options.http_port, options.grpc_port, options.metrics_port) == (9000, 9001, 9002)
    assert options.model_control == "explicit"
    assert options.load_models == ("*",)
    monkeypatch.setenv("RESPONSE_CACHE_BYTES", "1048576")
    options = options_from_env(Path("repo"))
    assert options.response_cache_bytes == 1048576
    assert "--cache-config=local,size=1048576" in TritonServer(options, install=find_triton()).command()


def test_options_defaults(monkeypatch):
    for name in ("HTTP_PORT", "GRPC_PORT", "METRICS_PORT", "MODEL_CONTROL", "RESPONSE_CACHE_BYTES"):
        monkeypatch.delenv(name, raising=False)
    options = options_from_env(Path("repo"))
    assert (options.http_port, options.grpc_port, options.metrics_port) == (8000, 8001, 8002)
    assert options.model_control == "none"
    assert options.response_cache_bytes == 0
    assert not any(a.startswith("--cache-config") for a in TritonServer(options, install=find_triton()).command())


@pytest.mark.parametrize(("name", "value", "fragment"), [
    ("HTTP_PORT", "http", "HTTP_PORT='http' is not a port number"),
    ("GRPC_PORT", "70000", "outside 1..65535"),
    ("MODEL_CONTROL", "sometimes", "expected none, explicit or poll"),
    ("RESPONSE_CACHE_BYTES", "1GB", "expected a number of bytes"),
])
def test_bad_env_is_named(monkeypatch, name, value, fragment):
    monkeypatch.setenv(name, value)
    with pytest.raises(LaunchError, match=fragment):
        options_from_env(Path("repo"))


def test_backend_dir_layout(tmp_path):
    install = find_triton()
    root = assemble_backend_dir(install, tmp_path / "backends")
    for rel in ("python/libtriton_python.so", "python/triton_python_backend_utils.py",
                "python/triton_python_backend_stub", "coalesce/model.py", "coalesce/coalesce/batching/pipeline.py",
                "coalesce/coalesce/tasks/tensor/task.py"):
        assert (root / rel).exists(), rel
    # Only what runs in the stub: the developer tools are never put beside the backend.
    assert not (root / "coalesce" / "coalesce_tools").exists()
    assert not (root / "coalesce" / "coalesce" / "cli.py").exists()

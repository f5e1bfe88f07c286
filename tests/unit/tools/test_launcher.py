"""The launcher: options from the environment, the server's command line and the backend directory it assembles."""

from pathlib import Path

import pytest

from coalesce_tools.launcher import (
    ADMIN_APIS,
    ADMIN_KEY_ENV,
    ADMIN_KEY_FILE_ENV,
    GrpcTls,
    LaunchError,
    ServerOptions,
    TritonServer,
    assemble_backend_dir,
    find_triton,
    options_from_env,
)


def test_options_from_env(monkeypatch):
    monkeypatch.setenv("HTTP_PORT", "9000")
    monkeypatch.setenv("GRPC_PORT", "9001")
    monkeypatch.setenv("METRICS_PORT", "9002")
    monkeypatch.setenv("MODEL_CONTROL", "explicit")
    options = options_from_env(Path("repo"))
    assert (options.http_port, options.grpc_port, options.metrics_port) == (9000, 9001, 9002)
    assert options.model_control == "explicit"
    assert "--load-model=*" in TritonServer(options, install=find_triton()).command()  # the whole repository
    monkeypatch.setenv("RESPONSE_CACHE_BYTES", "1048576")
    options = options_from_env(Path("repo"))
    assert options.response_cache_bytes == 1048576
    assert "--cache-config=local,size=1048576" in TritonServer(options, install=find_triton()).command()


def test_options_defaults(monkeypatch):
    for name in ("HTTP_PORT", "GRPC_PORT", "METRICS_PORT", "MODEL_CONTROL", "RESPONSE_CACHE_BYTES", "HOST",
                 ADMIN_KEY_ENV, ADMIN_KEY_FILE_ENV, "GRPC_TLS_CERT", "GRPC_TLS_KEY", "HEALTH_PORT"):
        monkeypatch.delenv(name, raising=False)
    options = options_from_env(Path("repo"))
    assert (options.http_port, options.grpc_port, options.metrics_port) == (8000, 8001, 8002)
    assert options.model_control == "none"
    assert options.host == "127.0.0.1"  # the network only when told (HOST)
    assert options.supervisor.health_port == 8003
    assert options.response_cache_bytes == 0
    assert not any(a.startswith("--cache-config") for a in TritonServer(options, install=find_triton()).command())


@pytest.mark.parametrize(("name", "value", "fragment"), [
    ("HTTP_PORT", "http", "HTTP_PORT='http' is not a port number"),
    ("GRPC_PORT", "70000", "outside 1..65535"),
    ("MODEL_CONTROL", "sometimes", "expected none, explicit or poll"),
    ("RESPONSE_CACHE_BYTES", "1GB", "expected a number of bytes"),
    ("HEALTH_PORT", "-1", "outside 0..65535"),
    ("GRPC_TLS_CERT", "/nonexistent.pem", "gRPC TLS needs readable PEM files"),
    (ADMIN_KEY_FILE_ENV, "/nonexistent-key", "cannot read it"),
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


def _restricted(command: list[str]) -> list[str]:
    return [a for a in command if a.startswith(("--http-restricted-api", "--grpc-restricted-protocol"))]


def test_admin_api_locked_under_none_with_a_key_nobody_knows():
    server = TritonServer(ServerOptions(model_repository=Path("repo")), install=find_triton())
    command = server.command()
    assert "--model-control-mode=explicit" in command  # so the supervisor can reload a crashed model
    assert "--http-address=127.0.0.1" in command
    restricted = _restricted(command)
    key = server.admin_headers["admin-key"]
    assert len(key) >= 32
    assert restricted == [f"--http-restricted-api={','.join(ADMIN_APIS)}:admin-key={key}",
                          f"--grpc-restricted-protocol={','.join(ADMIN_APIS)}:admin-key={key}"]
    assert not {"inference", "health", "metadata"} & set(ADMIN_APIS)
    other = TritonServer(ServerOptions(model_repository=Path("repo")), install=find_triton())
    assert other.admin_headers != server.admin_headers  # a fresh key each start


def test_explicit_control_needs_a_key_off_loopback(monkeypatch):
    with pytest.raises(LaunchError, match=f"set {ADMIN_KEY_ENV}"):
        ServerOptions(model_repository=Path("repo"), host="0.0.0.0", model_control="explicit")
    monkeypatch.setenv("HOST", "0.0.0.0")
    monkeypatch.setenv("MODEL_CONTROL", "explicit")
    with pytest.raises(LaunchError, match="without an admin key"):
        options_from_env(Path("repo"))
    monkeypatch.setenv(ADMIN_KEY_ENV, "s3cret")
    options = options_from_env(Path("repo"))
    assert "s3cret" not in repr(options)
    assert _restricted(TritonServer(options, install=find_triton()).command())[0].endswith(":admin-key=s3cret")
    # On loopback without a key, explicit control stays open to this machine (the operator's choice).
    local = ServerOptions(model_repository=Path("repo"), model_control="explicit")
    assert _restricted(TritonServer(local, install=find_triton()).command()) == []


def test_admin_key_from_a_file(monkeypatch, tmp_path):
    monkeypatch.delenv(ADMIN_KEY_ENV, raising=False)
    (tmp_path / "key").write_text("from-a-file\n")
    monkeypatch.setenv(ADMIN_KEY_FILE_ENV, str(tmp_path / "key"))
    assert options_from_env(Path("repo")).admin_key == "from-a-file"
    (tmp_path / "key").write_text("\n")
    with pytest.raises(LaunchError, match="holds no key"):
        options_from_env(Path("repo"))


def test_grpc_tls_flags(monkeypatch, tmp_path):
    for name in ("cert.pem", "key.pem", "ca.pem"):
        (tmp_path / name).write_text("PEM")
    monkeypatch.setenv("GRPC_TLS_CERT", str(tmp_path / "cert.pem"))
    monkeypatch.setenv("GRPC_TLS_KEY", str(tmp_path / "key.pem"))
    options = options_from_env(Path("repo"))
    assert options.grpc_tls == GrpcTls(cert=tmp_path / "cert.pem", key=tmp_path / "key.pem")
    assert "--grpc-use-ssl=true" in TritonServer(options, install=find_triton()).command()
    monkeypatch.setenv("GRPC_TLS_CA", str(tmp_path / "ca.pem"))
    command = TritonServer(options_from_env(Path("repo")), install=find_triton()).command()
    assert {"--grpc-use-ssl-mutual=true", f"--grpc-root-cert={tmp_path / 'ca.pem'}"} <= set(command)


def test_the_environment_option_reaches_the_server_and_stays_out_of_repr(monkeypatch):
    monkeypatch.setenv("COALESCE_REDIS_PASSWORD_FILE", "/from/this/process")
    options = ServerOptions(model_repository=Path("repo"),
                            environment={"COALESCE_REDIS_PASSWORD_FILE": "/run/cluster/redis-password"})
    env = TritonServer(options, install=find_triton()).environment()
    assert env["COALESCE_REDIS_PASSWORD_FILE"] == "/run/cluster/redis-password"  # the option wins
    assert "LD_LIBRARY_PATH" in env
    assert "redis-password" not in repr(options)
    assert "COALESCE_REDIS_PASSWORD_FILE" not in TritonServer(ServerOptions(model_repository=Path("repo")),
                                                              install=find_triton()).options.environment

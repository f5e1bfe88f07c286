"""Running the gateway: in this process (``coalesce gateway``), or as a supervised child of ``coalesce serve``."""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO

from coalesce_tools.gateway.options import API_KEY_ENV, API_KEY_FILE_ENV, GatewayOptions, GatewayOptionsError


def run(options: GatewayOptions) -> None:
    """Serve the gateway until interrupted: uvicorn with uvloop and httptools, no access log."""
    import uvicorn

    from coalesce_tools.gateway.app import create_app

    uvicorn.run(create_app(options), host=options.host, port=options.port, loop="uvloop", http="httptools",
                log_level="warning", access_log=False, timeout_graceful_shutdown=10)


def main(argv: list[str] | None = None) -> int:
    """``coalesce gateway``: the OpenAI/Cohere-style routes in front of a running Triton."""
    parser = argparse.ArgumentParser(
        prog="coalesce gateway",
        description="OpenAI- and Cohere-style HTTP routes (/v1/embeddings, /v1/rerank, /v1/score, /v1/completions, "
                    "/v1/chat/completions, /v1/models) in front of a Triton server's gRPC API. Keys: "
                    "COALESCE_API_KEY or COALESCE_API_KEY_FILE; body limit: OPENAI_MAX_BODY_BYTES.")
    parser.add_argument("--model-repository", type=Path, default=Path("model_repository"),
                        help="the folder Triton serves (tokenizers and chat templates are read there)")
    parser.add_argument("--triton-grpc-url", default=None,
                        help="Triton's gRPC endpoint (default 127.0.0.1:$GRPC_PORT, 8001)")
    parser.add_argument("--host", default=None, help="address to bind (default $HOST, 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None, help="port (default $OPENAI_PORT, 9000)")
    parser.add_argument("--max-body-bytes", type=int, default=None,
                        help="largest request body (default $OPENAI_MAX_BODY_BYTES, 8 MiB)")
    parser.add_argument("--request-timeout-s", type=float, default=None,
                        help="seconds a Triton call may take before the client gets 504 (default 600)")
    args = parser.parse_args(argv)
    url = args.triton_grpc_url or f"127.0.0.1:{os.environ.get('GRPC_PORT', '8001')}"
    try:
        options = GatewayOptions.from_env(args.model_repository, triton_grpc_url=url, host=args.host, port=args.port)
        changes = {"max_body_bytes": args.max_body_bytes, "request_timeout_s": args.request_timeout_s}
        options = dataclasses.replace(options, **{k: v for k, v in changes.items() if v is not None})
    except GatewayOptionsError as exc:
        sys.stderr.write(f"coalesce gateway: {exc}\n")
        return 2
    run(options)
    return 0


class GatewayProcess:
    """The gateway as a child process beside a Triton server: started, waited for, restarted if it dies, stopped."""

    def __init__(self, options: GatewayOptions, *, echo: IO[str] | None = None, ready_timeout_s: float = 60.0) -> None:
        """Nothing starts until ``start``."""
        self.options = options
        self._echo = echo
        self._ready_timeout_s = ready_timeout_s
        self._process: subprocess.Popen[bytes] | None = None
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None
        self._keys_file: Path | None = None
        self.restarts = 0

    @property
    def url(self) -> str:
        """Base URL for a client on this machine."""
        from coalesce_tools.launcher import connect_host

        return f"http://{connect_host(self.options.host)}:{self.options.port}"

    def command(self) -> list[str]:
        """The child's command line (its keys and limits travel in the environment, as given)."""
        return [sys.executable, "-m", "coalesce_tools.gateway", "--model-repository",
                str(self.options.model_repository), "--triton-grpc-url", self.options.triton_grpc_url,
                "--host", self.options.host, "--port", str(self.options.port),
                "--max-body-bytes", str(self.options.max_body_bytes),
                "--request-timeout-s", str(self.options.request_timeout_s)]

    def _spawn(self) -> None:
        from coalesce_tools.launcher import ADMIN_KEY_ENV, ADMIN_KEY_FILE_ENV

        # Secrets travel in the environment (never on the command line, which any user can read): the
        # admin key for the index, and the bearer keys (a file of them, readable by this user alone).
        environment = {k: v for k, v in os.environ.items()
                       if k not in (ADMIN_KEY_ENV, ADMIN_KEY_FILE_ENV, API_KEY_ENV, API_KEY_FILE_ENV)}
        if self.options.triton_admin_key:
            environment[ADMIN_KEY_ENV] = self.options.triton_admin_key
        if self.options.api_keys:
            if self._keys_file is None:
                descriptor, name = tempfile.mkstemp(prefix="coalesce-gateway-keys-")
                with os.fdopen(descriptor, "w") as keys:
                    keys.write("\n".join(self.options.api_keys) + "\n")
                self._keys_file = Path(name)
            environment[API_KEY_FILE_ENV] = str(self._keys_file)
        from coalesce_tools.launcher import set_parent_death_signal

        # Like the server it fronts, it gets SIGTERM if its launcher dies: a killed run leaves no gateway behind.
        self._process = subprocess.Popen(self.command(), env=environment,
                                         stdout=None if self._echo else subprocess.DEVNULL,
                                         stderr=None if self._echo else subprocess.DEVNULL,
                                         preexec_fn=set_parent_death_signal)

    def start(self) -> GatewayProcess:
        """Start the child and wait until ``/health`` answers (Triton ready behind it).

        Raises:
            RuntimeError: If it exits, does not answer within the timeout, or ``stop`` came first.
        """
        if self._stopping.is_set():
            raise RuntimeError("the gateway was stopped before it started")
        self._spawn()
        self._wait_ready()
        self._watcher = threading.Thread(target=self._watch, name="coalesce-gateway-watch", daemon=True)
        self._watcher.start()
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self._ready_timeout_s
        while time.monotonic() < deadline:
            assert self._process is not None
            if self._stopping.is_set():
                raise RuntimeError("the gateway was stopped while it started")
            if self._process.poll() is not None:
                raise RuntimeError(f"the gateway exited with code {self._process.returncode} while starting "
                                   f"(command: {' '.join(self.command())})")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        raise RuntimeError(f"the gateway did not answer {self.url}/health within {self._ready_timeout_s:.0f} s")

    def _watch(self) -> None:
        # Supervised like the server's stubs: a gateway that dies is started again, after a pause.
        while not self._stopping.is_set():
            process = self._process
            if process is not None and process.poll() is not None and not self._stopping.is_set():
                sys.stderr.write(f"coalesce serve: the gateway exited with code {process.returncode}; restarting\n")
                self.restarts += 1
                time.sleep(1.0)
                if not self._stopping.is_set():
                    self._spawn()
            self._stopping.wait(0.5)

    @property
    def pid(self) -> int | None:
        """The child's pid while it runs."""
        return self._process.pid if self._process is not None and self._process.poll() is None else None

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the child (SIGTERM: open streams are cut, then it exits)."""
        self._stopping.set()
        process = self._process
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self._keys_file is not None:
            self._keys_file.unlink(missing_ok=True)
            self._keys_file = None

    def __enter__(self) -> GatewayProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

"""The ``coalesce`` command: ``serve``, ``prepare``, ``export``, ``settings``, ``tune`` and ``build-engine``."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path
from types import FrameType

from coalesce_tools.launcher import (
    LaunchError,
    RedisServer,
    ServerOptions,
    TritonServer,
    options_from_env,
    start_local_redis,
)

SAMPLE_TEXT = "Coalesce turns dynamic batches into few forward passes."


def _serve(args: argparse.Namespace) -> int:
    try:
        options = options_from_env(args.model_repository, explicit=True if args.explicit else None,
                                   load_models=args.load_model or ())
        server = TritonServer(options, echo=None if args.quiet else sys.stderr)
    except LaunchError as exc:
        sys.stderr.write(f"coalesce serve: {exc}\n")
        return 2
    try:
        redis_servers = start_local_redis(options.model_repository)
    except LaunchError as exc:
        sys.stderr.write(f"coalesce serve: {exc}\n")
        return 1
    try:
        return _run(server, options, redis_servers)
    finally:
        for redis in redis_servers:
            redis.stop()


def _run(server: TritonServer, options: ServerOptions, redis_servers: list[RedisServer]) -> int:
    for redis in redis_servers:
        sys.stderr.write(f"coalesce serve: started redis-server on {redis.url} for the shared row cache\n")
    sys.stderr.write(f"coalesce serve: starting {server.install.origin} on {options.model_repository} "
                     f"(model control: {options.model_control})\n")
    try:
        server.start()
    except LaunchError as exc:
        sys.stderr.write(f"coalesce serve: {exc}\n")
        return 1

    stopping = threading.Event()

    def forward(signum: int, frame: FrameType | None) -> None:
        # Drain (unload every model: accepted requests finish, new ones are refused), then stop Triton;
        # from a thread, since draining takes seconds and a signal handler must return. A second
        # signal stops Triton at once.
        if stopping.is_set():
            server.send_signal(signal.SIGINT)
            return
        stopping.set()
        threading.Thread(target=server.stop, name="coalesce-shutdown", daemon=True).start()

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    http, grpc = server.http_url, server.grpc_url
    models = _models(options.model_repository)
    listing = "".join(f"  {name:<16} task {task}\n" for name, task in models)
    text_model = next((name for name, task in models if task in ("embedding", "classify")), None)
    example = (
        "Try:\n"
        f"  curl -s -X POST http://{http}/v2/models/{text_model}/infer -H 'Content-Type: application/json' \\\n"
        f"    -d '{{\"inputs\":[{{\"name\":\"TEXT\",\"datatype\":\"BYTES\",\"shape\":[1,1],"
        f"\"data\":[\"{SAMPLE_TEXT}\"]}}]}}'\n\n") if text_model else ""
    sys.stdout.write(
        f"\nTriton is ready.\n"
        f"  HTTP     http://{http}\n  gRPC     {grpc}\n  metrics  {server.metrics_url}\n\n"
        f"Coalesce models:\n{listing}\n{example}"
        "Ctrl-C stops the server.\n")
    sys.stdout.flush()
    code = server.wait()
    server.stop()
    sys.stderr.write(f"coalesce serve: tritonserver exited with code {code}\n")
    # A clean shutdown on our signal is success; anything else is the server's own code.
    return 0 if code in (0, -signal.SIGINT) else code


def _models(repository: Path) -> list[tuple[str, str]]:
    """(name, task) of each coalesce model of the repository."""
    from coalesce_tools.config import ConfigReadError, coalesce_models, parameter

    try:
        return [(config.get("name") or path.name, parameter(config, "task", "embedding"))
                for path, config in coalesce_models(repository)]
    except ConfigReadError:
        return []


def settings_rows() -> list[tuple[str, str, str, str, str]]:
    """(parameter, default, component, tasks, meaning) of every ``config.pbtxt`` parameter, in declaration order."""
    from coalesce.settings import COMPONENTS, PAD_VALUE_PREFIX, parameter_fields

    rows = []
    for attr, options in COMPONENTS:
        applies = getattr(options, "APPLIES_TO", None)
        tasks = ", ".join(applies) if applies else "all"
        for field in parameter_fields(options):
            default = str(field.default).lower() if isinstance(field.default, bool) else str(field.default)
            rows.append((field.name, default, attr, tasks, str(field.metadata["doc"])))
        if attr == "tensor":
            rows.append((f"{PAD_VALUE_PREFIX}<input>", "0", "tensor", "tensor",
                         "Value the variable dims of input <input> are padded with (one key per input)."))
    return rows


def _settings(args: argparse.Namespace) -> int:
    rows = settings_rows()
    if args.markdown:
        sys.stdout.write("| parameter | default | component | tasks | meaning |\n| --- | --- | --- | --- | --- |\n")
        for name, default, component, tasks, doc in rows:
            shown = f"`{default}`" if default else "(empty)"
            sys.stdout.write(f"| `{name}` | {shown} | {component} | {tasks} | {doc} |\n")
        return 0
    sys.stdout.write("parameter\tdefault\tcomponent\ttasks\tmeaning\n")
    for row in rows:
        sys.stdout.write("\t".join(row) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``coalesce`` console script."""
    parser = argparse.ArgumentParser(prog="coalesce", description="Coalesce: dynamic batching that pays off.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="start tritonserver on a model repository with the coalesce backend",
                           description="Binds HOST (127.0.0.1); ports HTTP_PORT, GRPC_PORT, METRICS_PORT, HEALTH_PORT "
                                       "(8000, 8001, 8002, 8003: the supervisor's /ready and /live). "
                                       "MODEL_CONTROL=explicit (or --explicit) opens the repository API to holders "
                                       "of COALESCE_ADMIN_KEY (or COALESCE_ADMIN_KEY_FILE); required off loopback. "
                                       "GRPC_TLS_CERT, GRPC_TLS_KEY (+ GRPC_TLS_CA: mutual) turn on gRPC TLS.")
    serve.add_argument("--model-repository", type=Path, default=Path("model_repository"))
    serve.add_argument("--explicit", action="store_true", help="explicit model control (load/unload over the API)")
    serve.add_argument("--load-model", action="append", help="model to load at start (repeatable; default: all)")
    serve.add_argument("--quiet", action="store_true", help="do not echo the server log")
    serve.set_defaults(func=_serve)
    export = sub.add_parser("export", help="export a Hugging Face folder (or an example model's recipe) to ONNX",
                            add_help=False)
    export.set_defaults(func=None)
    prepare = sub.add_parser("prepare", help="build what a repository's models need (recipes), check the rest",
                             add_help=False)
    prepare.set_defaults(func=None)
    settings = sub.add_parser("settings", help="list the backend's config.pbtxt parameters")
    settings.add_argument("--markdown", action="store_true", help="as the table in backends/coalesce/README.md")
    settings.set_defaults(func=_settings)
    tune = sub.add_parser("tune", help="sweep batching settings with perf_analyzer and pick a config", add_help=False)
    tune.set_defaults(func=None)
    engine = sub.add_parser("build-engine", help="build a TensorRT plan with profiles from the model config",
                            add_help=False)
    engine.set_defaults(func=None)
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "export":
        from coalesce_tools.export import main as export_main

        return export_main(argv[1:])
    if argv and argv[0] == "prepare":
        from coalesce_tools.export import prepare_main

        return prepare_main(argv[1:])
    if argv and argv[0] == "build-engine":
        from coalesce_tools.engine import main as engine_main

        return engine_main(argv[1:])
    if argv and argv[0] == "tune":
        from coalesce_tools.tune import main as tune_main

        return tune_main(argv[1:])
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())

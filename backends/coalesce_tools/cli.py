"""The ``coalesce`` command: serve, gateway, cluster, prepare, export, settings, tune and build-engine."""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from coalesce_tools.launcher import (
    LaunchError,
    RedisServer,
    ServerOptions,
    TritonServer,
    connect_host,
    options_from_env,
    start_local_redis,
)

if TYPE_CHECKING:
    from coalesce_tools.gateway.options import GatewayOptions

SAMPLE_TEXT = "Coalesce turns dynamic batches into few forward passes."


def _serve(args: argparse.Namespace) -> int:
    from coalesce_tools.gateway.options import GatewayOptions, GatewayOptionsError

    try:
        options = options_from_env(args.model_repository, explicit=True if args.explicit else None,
                                   load_models=args.load_model or ())
        server = TritonServer(options, echo=None if args.quiet else sys.stderr)
        gateway: GatewayOptions | None = GatewayOptions.from_env(options.model_repository,
                                          triton_grpc_url=f"{connect_host(options.host)}:{options.grpc_port}",
                                          host=options.host)
    except (LaunchError, GatewayOptionsError) as exc:
        sys.stderr.write(f"coalesce serve: {exc}\n")
        return 2
    if options.grpc_tls is not None or (gateway is not None and gateway.port == 0):
        # The gateway talks to Triton over plain gRPC on this machine; under gRPC TLS it stays off.
        gateway = None
    needed = ("starlette", "uvicorn", "orjson", "prometheus_client")
    missing = [m for m in needed if importlib.util.find_spec(m) is None]
    if gateway is not None and missing:
        sys.stderr.write(f"coalesce serve: the OpenAI gateway is off: this Python lacks {', '.join(missing)} "
                         "(pip install 'coalesce[gateway]')\n")
        gateway = None
    try:
        redis_servers = start_local_redis(options.model_repository)
    except LaunchError as exc:
        sys.stderr.write(f"coalesce serve: {exc}\n")
        return 1
    try:
        return _run(server, options, redis_servers, gateway)
    finally:
        for redis in redis_servers:
            redis.stop()


def _run(server: TritonServer, options: ServerOptions, redis_servers: list[RedisServer],
         gateway_options: GatewayOptions | None) -> int:
    for redis in redis_servers:
        sys.stderr.write(f"coalesce serve: started redis-server on {redis.url} for the shared row cache\n")
    sys.stderr.write(f"coalesce serve: starting {server.install.origin} on {options.model_repository} "
                     f"(model control: {options.model_control})\n")
    try:
        server.start()
    except LaunchError as exc:
        sys.stderr.write(f"coalesce serve: {exc}\n")
        return 1
    gateway = None
    if gateway_options is not None:
        import dataclasses

        from coalesce_tools.gateway.server import GatewayProcess
        from coalesce_tools.launcher import ADMIN_HEADER

        gateway = GatewayProcess(dataclasses.replace(
            gateway_options, triton_admin_key=server.admin_headers.get(ADMIN_HEADER)), echo=sys.stderr)

    stopping = threading.Event()

    def forward(signum: int, frame: FrameType | None) -> None:
        # Drain (unload every model: accepted requests finish, new ones are refused), then stop Triton;
        # from a thread, since draining takes seconds and a signal handler must return. A second
        # signal stops Triton at once.
        if stopping.is_set():
            server.send_signal(signal.SIGINT)
            return
        stopping.set()
        if gateway is not None:
            gateway.stop()
        threading.Thread(target=server.stop, name="coalesce-shutdown", daemon=True).start()

    # The handlers go in before the gateway starts: a signal while it starts (Triton already answers)
    # must drain and stop everything, not kill this process and leave Triton to its parent-death signal.
    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    if gateway is not None:
        try:
            gateway.start()
        except RuntimeError as exc:
            if not stopping.is_set():
                sys.stderr.write(f"coalesce serve: {exc}; stopping Triton\n")
                stopping.set()
                gateway.stop()
                server.stop()
                return 1
    http, grpc = server.http_url, server.grpc_url
    models = _models(options.model_repository)
    listing = "".join(f"  {name:<16} task {task}\n" for name, task in models)
    text_model = next((name for name, task in models if task == "embedding"), None)
    example = (
        "Try:\n"
        f"  curl -s -X POST http://{http}/v2/models/{text_model}/infer -H 'Content-Type: application/json' \\\n"
        f"    -d '{{\"inputs\":[{{\"name\":\"TEXT\",\"datatype\":\"BYTES\",\"shape\":[1,1],"
        f"\"data\":[\"{SAMPLE_TEXT}\"]}}]}}'\n") if text_model else ""
    if gateway is not None and text_model:
        example += (f"  curl -s {gateway.url}/v1/embeddings -H 'Content-Type: application/json' \\\n"
                    f"    -d '{{\"model\":\"{text_model}\",\"input\":\"{SAMPLE_TEXT}\"}}'\n")
    example += "\n" if example else ""
    front = (f"  OpenAI   {gateway.url}/v1 (embeddings, rerank, score, completions, chat/completions, models)\n"
             if gateway is not None else "")
    sys.stdout.write(
        f"\nTriton is ready.\n"
        f"  HTTP     http://{http}\n  gRPC     {grpc}\n  metrics  {server.metrics_url}\n{front}\n"
        f"Coalesce models:\n{listing}\n{example}"
        "Ctrl-C stops the server.\n")
    sys.stdout.flush()
    code = server.wait()
    if gateway is not None:
        gateway.stop()
    server.stop()
    sys.stderr.write(f"coalesce serve: tritonserver exited with code {code}\n")
    # A clean shutdown on our signal is success; anything else is the server's own code.
    return 0 if code in (0, -signal.SIGINT) else code


def _port(text: str) -> int:
    """An argparse type: a TCP port (0 where the option says it means a free one)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value < 65536:
        raise argparse.ArgumentTypeError(f"{text!r} is outside 0..65535")
    return value


def _cluster(args: argparse.Namespace) -> int:
    from coalesce_tools.cluster import BalancerOptions, Cluster, ClusterOptions

    def say(line: str) -> None:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()

    try:
        balancer = BalancerOptions(host=args.host, http_port=args.http_port, grpc_port=args.grpc_port,
                                   stats_port=args.stats_port)
        options = ClusterOptions(model_repository=args.model_repository, replicas=args.replicas, balancer=balancer,
                                 replica_port_base=args.replica_port_base, redis_port=args.redis_port,
                                 load_models=tuple(args.load_model or ()), restart=not args.no_restart)
    except LaunchError as exc:
        sys.stderr.write(f"coalesce cluster: {exc}\n")
        return 2
    cluster = Cluster(options, echo=None if args.quiet else sys.stderr, log=say)
    stopping = threading.Event()

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt  # as SIGINT does: start() stops what it started, then lets it through

    def on_signal(signum: int, frame: FrameType | None) -> None:
        # The first signal stops everything cleanly (the main thread does it); a second kills it all at once.
        if stopping.is_set():
            cluster.kill()
        stopping.set()

    signal.signal(signal.SIGTERM, interrupt)
    say(f"coalesce cluster: starting {options.replicas} replica(s) of {options.model_repository}, "
        "a redis-server and haproxy")
    try:
        cluster.start()
    except LaunchError as exc:
        sys.stderr.write(f"coalesce cluster: {exc}\n")
        return 1
    except KeyboardInterrupt:
        say("coalesce cluster: interrupted while starting; stopped what had started")
        return 130
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    code = 0
    try:
        assert cluster.balancer is not None and cluster.redis is not None
        b = cluster.balancer
        replicas = "".join(
            f"  {r.name:<4} HTTP {r.http_url}  gRPC {r.grpc_url}  metrics {r.metrics_url}  "
            f"health http://127.0.0.1:{r.ports.health}/ready\n" for r in cluster.replicas)
        sys.stdout.write(
            f"\nCluster is ready: {len(cluster.replicas)} tritonserver replicas behind haproxy.\n"
            f"  HTTP     http://{b.http_url}   (balanced)\n  gRPC     {b.grpc_url}   (balanced)\n"
            f"  stats    {b.stats_url}   (Prometheus: /metrics)\n"
            f"  Redis    {cluster.redis.url}   (password in {cluster.redis_password_file})\n"
            f"Replicas:\n{replicas}\nCtrl-C stops the cluster.\n")
        sys.stdout.flush()
        while not stopping.wait(1.0):
            if not cluster.alive:
                assert cluster.balancer is not None
                say(f"coalesce cluster: haproxy exited with code {cluster.balancer.returncode}; stopping:\n"
                    f"{cluster.balancer.log_tail()}")
                code = 1
                break
    finally:
        say("coalesce cluster: stopping (haproxy, then each replica after its requests, then redis-server)")
        cluster.stop()
    return code


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
                                       "GRPC_TLS_CERT, GRPC_TLS_KEY (+ GRPC_TLS_CA: mutual) turn on gRPC TLS. "
                                       "The OpenAI/Cohere-style gateway listens on OPENAI_PORT (9000; 0: off) "
                                       "beside Triton; COALESCE_API_KEY[_FILE] sets its bearer keys.")
    serve.add_argument("--model-repository", type=Path, default=Path("model_repository"))
    serve.add_argument("--explicit", action="store_true", help="explicit model control (load/unload over the API)")
    serve.add_argument("--load-model", action="append", help="model to load at start (repeatable; default: all)")
    serve.add_argument("--quiet", action="store_true", help="do not echo the server log")
    serve.set_defaults(func=_serve)
    gateway = sub.add_parser("gateway", help="OpenAI/Cohere-style HTTP routes in front of a running Triton",
                             add_help=False)
    gateway.set_defaults(func=None)
    env = os.environ.get
    cluster = sub.add_parser(
        "cluster", help="N tritonserver replicas of a repository, one shared Redis, haproxy in front (HTTP, gRPC)",
        description="Starts a redis-server (with a password) for the shared row-cache tier, N replicas serving a "
                    "copy of the repository whose row-task models use it, and haproxy balancing HTTP and gRPC "
                    "over them with health checks and retries; a replica that exits is started again. Runs "
                    "until Ctrl-C or SIGTERM, then stops everything. Replica i listens on "
                    "REPLICA_PORT_BASE + 10 i (HTTP), +1 (gRPC), +2 (metrics), +3 (health).")
    cluster.add_argument("--replicas", type=int, default=2, help="tritonserver replicas (default 2)")
    cluster.add_argument("--model-repository", type=Path, default=Path("model_repository"))
    cluster.add_argument("--load-model", action="append", help="model to serve (repeatable; default: all)")
    cluster.add_argument("--host", default=env("HOST", "127.0.0.1"), help="address the balancer binds")
    cluster.add_argument("--http-port", type=_port, default=env("HTTP_PORT", "8000"), help="balanced HTTP")
    cluster.add_argument("--grpc-port", type=_port, default=env("GRPC_PORT", "8001"), help="balanced gRPC")
    cluster.add_argument("--stats-port", type=_port, default=env("STATS_PORT", "8404"),
                         help="haproxy's statistics (/stats) and Prometheus metrics (/metrics)")
    cluster.add_argument("--replica-port-base", type=_port, default=env("REPLICA_PORT_BASE", "8100"),
                         help="first port of replica 0 (0: free ports)")
    cluster.add_argument("--redis-port", type=_port, default=env("REDIS_PORT", "0"), help="0: a free port")
    cluster.add_argument("--no-restart", action="store_true", help="leave a replica that exits stopped")
    cluster.add_argument("--quiet", action="store_true", help="do not echo the replicas' and haproxy's logs")
    cluster.set_defaults(func=_cluster)
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
    if argv and argv[0] == "gateway":
        from coalesce_tools.gateway.server import main as gateway_main

        return gateway_main(argv[1:])
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

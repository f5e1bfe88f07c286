"""``coalesce-client``: embed texts or check health from the command line; prints JSON."""

from __future__ import annotations

import argparse
import json
import os
import sys

from coalesce_client.client import DEFAULT_URLS, EmbeddingClient, TlsOptions
from coalesce_client.errors import ClientError
from coalesce_client.retry import RetryPolicy


def grpc_beside(http_url: str) -> str:
    """The gRPC ``host:port`` of the server whose HTTP endpoint is ``http_url`` (Triton's default gRPC port)."""
    host = http_url.split("://", 1)[-1].rsplit(":", 1)[0] or "localhost"
    return f"{host}:{DEFAULT_URLS['grpc'].rsplit(':', 1)[1]}"


def parse_headers(pairs: list[str], env_pairs: list[str], environ: dict[str, str] | None = None) -> dict[str, str]:
    """Headers from ``NAME=VALUE`` pairs and from ``NAME=ENV_VAR`` pairs whose value is read from the environment.

    Raises:
        ValueError: A pair without ``=``, or an environment variable that is not set.
    """
    environ = dict(os.environ) if environ is None else environ
    headers: dict[str, str] = {}
    for option, items in (("--header", pairs), ("--header-env", env_pairs)):
        for item in items:
            name, sep, value = item.partition("=")
            if not sep or not name.strip() or not value:
                raise ValueError(f"{option} takes NAME={'ENV_VAR' if option == '--header-env' else 'VALUE'}, "
                                 f"got {item!r}")
            if option == "--header-env":
                if value not in environ:
                    raise ValueError(f"{option} {name}: environment variable {value} is not set")
                value = environ[value]
            headers[name.strip().lower()] = value
    return headers


def main(argv: list[str] | None = None) -> int:
    """Entry point; exit 0 on success, 1 when the call failed, 2 on bad usage."""
    parser = argparse.ArgumentParser(prog="coalesce-client", description=__doc__)
    parser.add_argument("--url", help=f"host:port (default {DEFAULT_URLS['grpc']} for grpc, "
                                      f"{DEFAULT_URLS['http']} for http)")
    parser.add_argument("--protocol", choices=("grpc", "http"), default="grpc")
    parser.add_argument("--model", default="minilm")
    parser.add_argument("--timeout-s", type=float, default=30.0,
                        help="deadline of each call, retries and split lists included")
    parser.add_argument("--max-attempts", type=int, default=RetryPolicy().max_attempts,
                        help="attempts per request when the server is unreachable or refuses (1: no retry)")
    parser.add_argument("--header", action="append", default=[], metavar="NAME=VALUE",
                        help="header sent with every request (repeatable)")
    parser.add_argument("--header-env", action="append", default=[], metavar="NAME=ENV_VAR",
                        help="header whose value is read from the environment variable ENV_VAR, "
                             "so a secret stays off the command line (repeatable)")
    parser.add_argument("--ca-cert", help="gRPC over TLS: PEM file of the CA that signed the server's certificate")
    parser.add_argument("--client-cert", help="mutual TLS: this client's PEM certificate (with --client-key)")
    parser.add_argument("--client-key", help="mutual TLS: this client's PEM private key")
    sub = parser.add_subparsers(dest="command", required=True)
    embed = sub.add_parser("embed", help="embed texts; prints {model, dim, embeddings}")
    embed.add_argument("texts", nargs="*", help="texts to embed")
    embed.add_argument("--stdin", action="store_true", help="read one text per line from standard input")
    sub.add_parser("health", help="prints {url, ready}")
    load = sub.add_parser("load", help="bounded closed-loop load; prints requests/s and Triton's average batch")
    load.add_argument("--requests", type=int, default=256)
    load.add_argument("--concurrency", type=int, default=32)
    load.add_argument("--texts-per-request", type=int, default=1)
    load.add_argument("--stats-url", help="gRPC host:port for Triton's statistics (default: --url's host, and "
                      "with --protocol http the gRPC port 8001 beside it)")
    args = parser.parse_args(argv)
    try:
        tls = (TlsOptions(args.ca_cert, args.client_cert, args.client_key)
               if args.ca_cert or args.client_cert or args.client_key else None)
        client = EmbeddingClient(args.url, protocol=args.protocol, model=args.model, timeout_s=args.timeout_s,
                                 retry=RetryPolicy(max_attempts=args.max_attempts), tls=tls,
                                 headers=parse_headers(args.header, args.header_env))
    except ValueError as exc:
        parser.error(str(exc))

    with client:
        if args.command == "health":
            ready = client.is_ready()
            json.dump({"url": client.url, "model": client.model, "ready": ready}, sys.stdout)
            sys.stdout.write("\n")
            return 0 if ready else 1
        if args.command == "load":
            from coalesce_client.load import run_load

            stats_url = args.stats_url or (client.url if args.protocol == "grpc" else grpc_beside(client.url))
            try:
                report = run_load(client, stats_url=stats_url, requests=args.requests,
                                  concurrency=args.concurrency, texts_per_request=args.texts_per_request)
            except ClientError as exc:
                sys.stderr.write(f"coalesce-client: {type(exc).__name__}: {exc}\n")
                return 1
            json.dump(report.as_dict(), sys.stdout)
            sys.stdout.write("\n")
            return 0
        texts = list(args.texts)
        if args.stdin:
            texts += [line.rstrip("\n") for line in sys.stdin]
        if not texts:
            parser.error("give texts to embed, or --stdin")
        try:
            vectors = client.embed(texts)
        except ClientError as exc:
            sys.stderr.write(f"coalesce-client: {type(exc).__name__}: {exc}\n")
            return 1
        json.dump({"model": client.model, "dim": int(vectors.shape[1]), "embeddings": vectors.tolist()}, sys.stdout)
        sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

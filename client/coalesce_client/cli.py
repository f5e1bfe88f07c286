"""``coalesce-client``: embed texts, check health, load a server or run a bulk job; prints JSON."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

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
    parser.add_argument("--url", action="append", help=f"host:port (default {DEFAULT_URLS['grpc']} for grpc, "
                                                       f"{DEFAULT_URLS['http']} for http); batch takes several "
                                                       "(repeat it) and spreads its requests over them")
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
    add_batch_parser(sub)
    args = parser.parse_args(argv)
    urls = args.url or [None]
    if len(urls) > 1 and args.command != "batch":
        parser.error(f"several --url are for the batch command; {args.command} takes one")
    try:
        tls = (TlsOptions(args.ca_cert, args.client_cert, args.client_key)
               if args.ca_cert or args.client_cert or args.client_key else None)
        clients = [EmbeddingClient(url, protocol=args.protocol, model=args.model, timeout_s=args.timeout_s,
                                   retry=RetryPolicy(max_attempts=args.max_attempts), tls=tls,
                                   headers=parse_headers(args.header, args.header_env)) for url in urls]
        if args.command == "batch":
            options = batch_options(args)
    except ValueError as exc:
        parser.error(str(exc))
    if args.command == "batch" and args.format == "openai":
        return run_openai_command(options, args, clients)
    if args.command == "batch":
        return run_batch_command(options, clients)
    client = clients[0]

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


def add_batch_parser(sub: Any) -> None:
    """The ``batch`` subcommand's arguments."""
    batch = sub.add_parser("batch", help="a bulk job: a JSONL, CSV or Parquet file of ids and texts to a Parquet "
                                         "file of ids and vectors (or scores); resumable; prints a JSON report")
    batch.add_argument("input", type=Path, help="JSONL (one object per line), CSV (with a header) or Parquet")
    batch.add_argument("output", type=Path, help="Parquet file written at the end (ids and the model's output)")
    batch.add_argument("--id-column", default="id", help="column of the row ids, strings or integers (default id)")
    batch.add_argument("--text-column", default="text", help="column of the texts (default text)")
    batch.add_argument("--pair-column", help="column of the second texts, for a pair model (TEXT_PAIR)")
    # batch.FORMATS, written out: the batch module (pyarrow) is imported only for a batch job.
    batch.add_argument("--format", choices=("jsonl", "csv", "parquet", "openai"),
                       help="input format (default: from the suffix); openai: an OpenAI batch file (custom_id, "
                            "method, url, body) to OpenAI's batch output JSONL, each line's model from its body")
    batch.add_argument("--openai-url", help="with --format openai: the gateway (http://host:port) that answers the "
                                            "/v1/chat/completions lines")
    batch.add_argument("--output-name", help="model output to write (default: the model's only output)")
    batch.add_argument("--rejects", type=Path, help="JSONL of rejected rows: line, id, reason, raw line "
                                                     "(default OUTPUT.rejects.jsonl)")
    batch.add_argument("--work-dir", type=Path, help="part files and the job's state (default OUTPUT.parts)")
    batch.add_argument("--rows-per-request", type=int, help="rows per request (default: the model's max_batch_size)")
    batch.add_argument("--concurrency", type=int, help="requests in flight (default: found by measuring)")
    batch.add_argument("--max-concurrency", type=int, default=32, help="upper bound of the search (default 32)")
    batch.add_argument("--part-rows", type=int, default=4096, help="rows per part file (default 4096)")
    batch.add_argument("--part-interval-s", type=float, default=2.0,
                       help="most seconds between part files: what a kill may lose (default 2)")
    batch.add_argument("--restart", action="store_true", help="start over: discard an earlier run's part files")
    batch.add_argument("--keep-parts", action="store_true", help="keep the part files after the merge")
    shown = batch.add_mutually_exclusive_group()
    shown.add_argument("--progress", dest="progress", action="store_true", default=None,
                       help="show the progress bar (default: when standard error is a terminal)")
    shown.add_argument("--no-progress", dest="progress", action="store_false")
    batch.add_argument("--seed", type=int, default=0, help="seed of the order requests go out in")
    batch.add_argument("--engine", choices=("local", "ray"), default="local",
                       help="local: this process sends every request; ray: Ray Data actors do, on the cluster at "
                            "--ray-address (pip install \"coalesce[ray]\"); --url node: each Ray node's own server "
                            "(its COALESCE_TRITON_URL)")
    batch.add_argument("--ray-address", help="the Ray cluster's head (host:port, or auto; default: a Ray instance "
                                             "started for the job)")
    batch.add_argument("--ray-batch-rows", type=int, default=4096,
                       help="rows of one Ray batch: sorted and sent by one actor, written as one part (default 4096)")
    batch.add_argument("--tokenizer", type=Path, help="the served model's tokenizer.json: rows are sorted by exact "
                                                      "token counts (default: an estimate from words and punctuation)")


def batch_options(args: argparse.Namespace) -> Any:
    """The ``BatchOptions`` of parsed ``batch`` arguments.

    Raises:
        ValueError: A setting that cannot work.
    """
    from coalesce_client.batch import BatchOptions

    progress = sys.stderr.isatty() if args.progress is None else args.progress
    return BatchOptions(input_path=args.input, output_path=args.output, id_column=args.id_column,
                        text_column=args.text_column, pair_column=args.pair_column,
                        input_format=None if args.format == "openai" else args.format,
                        output_name=args.output_name, rejects_path=args.rejects, work_dir=args.work_dir,
                        rows_per_request=args.rows_per_request, concurrency=args.concurrency,
                        max_concurrency=args.max_concurrency, part_rows=args.part_rows,
                        part_interval_s=args.part_interval_s, restart=args.restart, keep_parts=args.keep_parts,
                        progress=progress, seed=args.seed, tokenizer=args.tokenizer,
                        engine=args.engine, ray_address=args.ray_address, ray_batch_rows=args.ray_batch_rows)


def run_batch_command(options: Any, clients: list[EmbeddingClient]) -> int:
    """Run a bulk job; print its report. Exit 0 when done (rejected rows included), 1 when it stopped, 130 on Ctrl-C."""
    from coalesce_client.batch import run_batch

    try:
        report = run_batch(options, clients)
    except ClientError as exc:
        sys.stderr.write(f"coalesce-client: {type(exc).__name__}: {exc}\n")
        return 1
    except KeyboardInterrupt:
        sys.stderr.write(f"coalesce-client: interrupted; the rows written are kept in {options.parts}: run the same "
                         "command again to resume\n")
        sys.stderr.flush()
        # Requests still in flight would hold the exit until their deadline: their answers are not needed.
        os._exit(130)
    finally:
        for client in clients:
            client.close()
    json.dump(report.as_dict(), sys.stdout)
    sys.stdout.write("\n")
    return 0


def run_openai_command(options: Any, args: argparse.Namespace, unused: list[EmbeddingClient]) -> int:
    """Run an OpenAI batch file (``--format openai``), with clients per model on every ``--url``; print its report."""
    from coalesce_client.batch.openai import run_openai_batch

    for client in unused:  # made for --model; each line names its own
        client.close()
    tls = (TlsOptions(args.ca_cert, args.client_cert, args.client_key)
           if args.ca_cert or args.client_cert or args.client_key else None)
    headers = parse_headers(args.header, args.header_env)
    made: dict[str, list[EmbeddingClient]] = {}

    def clients_for(model: str) -> list[EmbeddingClient]:
        if model not in made:
            made[model] = [EmbeddingClient(url, protocol=args.protocol, model=model, timeout_s=args.timeout_s,
                                           retry=RetryPolicy(max_attempts=args.max_attempts), tls=tls,
                                           headers=headers) for url in args.url or [None]]
        return made[model]

    try:
        report = run_openai_batch(options, clients_for, openai_url=args.openai_url, headers=headers,
                                  chat_timeout_s=args.timeout_s, chat_attempts=args.max_attempts)
    except ClientError as exc:
        sys.stderr.write(f"coalesce-client: {type(exc).__name__}: {exc}\n")
        return 1
    except ValueError as exc:
        sys.stderr.write(f"coalesce-client: {exc}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write(f"coalesce-client: interrupted; the work done is kept in {options.parts}: run the same "
                         "command again to resume\n")
        sys.stderr.flush()
        os._exit(130)
    finally:
        for clients in made.values():
            for client in clients:
                client.close()
    json.dump(report.as_dict(), sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

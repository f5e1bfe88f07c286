"""Builds the bench report: ratio table, cost per million inferences, and plots."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

Point = Mapping[str, Any]


def write_summary(out_dir: Path, name: str, run: Mapping[str, Any], text: str) -> Path:
    """Write a run's committed summary: ``out_dir/name.json`` (the run) and ``out_dir/name.md`` (``text``).

    Returns:
        The markdown file's path.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(run, indent=2) + "\n")
    path = out_dir / f"{name}.md"
    path.write_text(text)
    return path


def cost_per_million(throughput_per_s: float, price_per_hour: float) -> float:
    """Dollars per million inferences at ``throughput_per_s`` on an instance costing ``price_per_hour``."""
    if throughput_per_s <= 0:
        return float("inf")
    return price_per_hour / (throughput_per_s * 3600.0) * 1e6


BASELINES = ("naive", "pytriton")


def rounds_of(value: Any) -> list[float]:
    """A ceiling's per-round values (a single number counts as one round)."""
    if isinstance(value, list):
        return [float(v) for v in value]
    return [float(value)] if isinstance(value, int | float) else []


def median(values: Sequence[float]) -> float | None:
    """The median, or None for no values."""
    ordered = sorted(values)
    if not ordered:
        return None
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def _by_round(points: Sequence[Point], **match: Any) -> dict[int, Point]:
    return {int(p.get("round", 0)): p for p in points if all(p.get(k) == v for k, v in match.items())}


def ratio_rows(points: Sequence[Point], limits: Mapping[str, Mapping[str, Any]],
               protocol: str) -> list[dict[str, Any]]:
    """One row per (profile, concurrency): coalesce over each baseline, ``limit@N`` and ``limit``, with p99s.

    Each system was measured once per round, its points next to each other, and the
    ceilings once per round beside them. Throughputs and p99s are medians over rounds;
    ratios are medians of the per-round ratios, so a machine that drifts between rounds
    moves both sides of a ratio alike. A baseline with no point gives ``None``.
    """
    rows = []
    for profile in sorted({p["profile"] for p in points}):
        for concurrency in sorted({p["concurrency"] for p in points if p["profile"] == profile}):
            ours = _by_round(points, system="coalesce", profile=profile, concurrency=concurrency, protocol=protocol)
            if not ours:
                continue
            ceiling = limits.get(profile, {})
            row: dict[str, Any] = {
                "profile": profile, "concurrency": concurrency, "protocol": protocol, "rounds": len(ours),
                "coalesce_per_s": median([p["throughput_per_s"] for p in ours.values()]),
                "coalesce_p99_ms": median([p["p99_ms"] for p in ours.values()]),
            }
            row["over_limit_at_batch"] = median([p["throughput_per_s"] / p["limit_at_batch"] for p in ours.values()
                                                 if p.get("limit_at_batch")])
            row["batch"] = median([p["avg_batch"] for p in ours.values() if p.get("avg_batch")])
            for name, key in (("over_limit_at_n", f"limit@{concurrency}"), ("over_limit", "limit")):
                values = rounds_of(ceiling.get(key))
                row[name] = median([ours[r]["throughput_per_s"] / v for r, v in enumerate(values)
                                    if r in ours and v > 0])
            for baseline in BASELINES:
                theirs = _by_round(points, system=baseline, profile=profile, concurrency=concurrency,
                                   protocol=protocol)
                row[f"{baseline}_per_s"] = median([p["throughput_per_s"] for p in theirs.values()])
                row[f"{baseline}_p99_ms"] = median([p["p99_ms"] for p in theirs.values()])
                row[f"over_{baseline}"] = median([ours[r]["throughput_per_s"] / theirs[r]["throughput_per_s"]
                                                  for r in theirs if r in ours])
            rows.append(row)
    return rows


def cache_rows(points: Sequence[Point], protocol: str) -> list[dict[str, Any]]:
    """One row per (profile, concurrency) where both ran: the cached variant over plain coalesce, same rounds."""
    rows = []
    for profile in sorted({p["profile"] for p in points}):
        for concurrency in sorted({p["concurrency"] for p in points if p["profile"] == profile}):
            plain = _by_round(points, system="coalesce", profile=profile, concurrency=concurrency, protocol=protocol)
            cached = _by_round(points, system="cached", profile=profile, concurrency=concurrency, protocol=protocol)
            shared = sorted(set(plain) & set(cached))
            if not shared:
                continue
            rows.append({"profile": profile, "concurrency": concurrency, "protocol": protocol,
                         "coalesce_per_s": median([plain[r]["throughput_per_s"] for r in shared]),
                         "cached_per_s": median([cached[r]["throughput_per_s"] for r in shared]),
                         "cached_p99_ms": median([cached[r]["p99_ms"] for r in shared]),
                         "cached_over_coalesce": median([cached[r]["throughput_per_s"] / plain[r]["throughput_per_s"]
                                                         for r in shared])})
    return rows


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def markdown(run: Mapping[str, Any]) -> str:
    """The report as Markdown: setup, ratio table, all points, ceilings, cost."""
    price = run["price_per_hour"]
    precision = [f"- like for like: {run['like_for_like']}"] if run.get("like_for_like") else []
    lines = [f"# Bench run {run['run']}", "", f"- machine: {run['machine']}", f"- command: `{run['command']}`",
             *precision, f"- workloads: {run['workloads']}", f"- instance price: ${price}/hour",
             f"- rounds: {run.get('rounds', 1)}: every system and ceiling measured once per round, side by side; "
             "throughputs and p99s are medians over rounds, ratios are medians of the same-round ratios", ""]
    notes = ["`x limit@batch`: coalesce over the in-process ceiling for windows as large as the average batch "
             "Triton's dynamic batcher actually handed it (measured right after the point), i.e. how close the "
             "backend gets to the best use of the requests it was given at once.", ""]
    for protocol in run["protocols"]:
        lines += [f"## Ratios ({protocol})", "", *notes,
                  "| profile | N | coalesce/s | p99 ms | naive/s | naive p99 ms | pytriton/s | pytriton p99 ms "
                  "| x naive | x pytriton | x limit@N | x limit | avg batch | x limit@batch |", "|" + " --- |" * 14]
        for r in ratio_rows(run["points"], run["limits"], protocol):
            cells = [r["profile"], str(r["concurrency"]), _fmt(r["coalesce_per_s"], 1), _fmt(r["coalesce_p99_ms"], 1)]
            for baseline in BASELINES:
                cells += [_fmt(r[f"{baseline}_per_s"], 1), _fmt(r[f"{baseline}_p99_ms"], 1)]
            cells += [_fmt(r["over_naive"]), _fmt(r["over_pytriton"]), _fmt(r["over_limit_at_n"]),
                      _fmt(r["over_limit"]), _fmt(r["batch"], 1), _fmt(r["over_limit_at_batch"])]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    for protocol in run["protocols"]:
        cached = cache_rows(run["points"], protocol)
        if cached:
            lines += [f"## Row cache ({protocol}): `cached` (minilm with cache_bytes 256 MiB) over plain coalesce", "",
                      "| profile | N | coalesce/s | cached/s | cached p99 ms | x (same-round median) |",
                      "| --- | --- | --- | --- | --- | --- |"]
            lines += [f"| {r['profile']} | {r['concurrency']} | {r['coalesce_per_s']:.1f} | {r['cached_per_s']:.1f} | "
                      f"{r['cached_p99_ms']:.1f} | {r['cached_over_coalesce']:.2f} |" for r in cached]
            lines.append("")
    lines += ["## Offline ceilings (texts/s, median over rounds)", "", "| profile | ceiling | texts/s |",
              "| --- | --- | --- |"]
    for profile, ceilings in sorted(run["limits"].items()):
        for name, value in ceilings.items():
            if name == "limit_how":
                hows = value if isinstance(value, list) else [value]
                lines.append(f"| {profile} | limit reached by | {'; '.join(map(str, hows))} |")
                continue
            values = rounds_of(value)
            if values:
                each = ", ".join(f"{v:.1f}" for v in values)
                lines.append(f"| {profile} | {name} | {median(values):.1f} (rounds: {each}) |")
    lines += ["", "## All points", "",
              "| round | system | profile | protocol | N | texts/s | p50 ms | p95 ms | p99 ms | queue ms | infer ms | "
              "avg batch | $/M inferences |", "|" + " --- |" * 13]
    for p in run["points"]:
        lines.append("| " + " | ".join([str(p.get("round", 0)), p["system"], p["profile"], p["protocol"],
                                         str(p["concurrency"]),
                                         _fmt(p["throughput_per_s"], 1), _fmt(p["p50_ms"], 1), _fmt(p["p95_ms"], 1),
                                         _fmt(p["p99_ms"], 1), _fmt(p["queue_ms"], 2), _fmt(p["compute_infer_ms"], 2),
                                         _fmt(p.get("avg_batch")),
                                         _fmt(cost_per_million(p["throughput_per_s"], price), 3)]) + " |")
    failed = run.get("failures", [])
    if failed:
        lines += ["", "## Points perf_analyzer could not measure", ""]
        lines += [f"- {f['system']} {f['profile']} {f['protocol']} N={f['concurrency']}: {f['error'][-160:]!r}"
                  for f in failed]
    lines += ["", "Plots: " + ", ".join(f"`{Path(p).name}`" for p in run.get("plots", [])), ""]
    return "\n".join(lines)


def plot(run: Mapping[str, Any], out_dir: Path) -> list[Path]:
    """Throughput vs p99 per system, batch-size histograms, and where time goes; PNG files."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = summarize(run["points"])
    paths = []
    profiles = sorted({p["profile"] for p in points})
    systems = [s for s in ("coalesce", *BASELINES, "cached") if any(p["system"] == s for p in points)]
    fig, axes = plt.subplots(1, len(profiles), figsize=(6 * len(profiles), 4.5), squeeze=False)
    for ax, profile in zip(axes[0], profiles, strict=True):
        for system in systems:
            for protocol in run["protocols"]:
                series = sorted((p for p in points if p["system"] == system and p["profile"] == profile
                                 and p["protocol"] == protocol), key=lambda p: p["concurrency"])
                if series:
                    ax.plot([p["p99_ms"] for p in series], [p["throughput_per_s"] for p in series], marker="o",
                            linestyle="-" if protocol == run["protocols"][0] else ":",
                            color=f"C{systems.index(system)}", label=f"{system} ({protocol})")
                    for p in series:
                        ax.annotate(str(p["concurrency"]), (p["p99_ms"], p["throughput_per_s"]), fontsize=7)
        best = median(rounds_of(run["limits"].get(profile, {}).get("limit")))
        if best is not None:
            ax.axhline(best, linestyle="--", color="grey", label="limit (offline)")
        ax.set_title(f"{profile}: throughput vs p99, medians (labels: concurrency)")
        ax.set_xlabel("p99 latency (ms)")
        ax.set_ylabel("texts/s")
        ax.set_xscale("log")
        ax.legend(fontsize=7)
    paths.append(out_dir / f"{run['run']}-throughput.png")
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    first = [p for p in points if p["protocol"] == run["protocols"][0]]
    fig, axes = plt.subplots(1, 1 + len(systems), figsize=(6 + 4 * len(systems), 4.5), squeeze=False)
    ax = axes[0][0]
    labels = [f"{p['system']}\n{p['profile'][:3]} N={p['concurrency']}" for p in first]
    bottom = [0.0] * len(first)
    for part in ("queue_ms", "compute_input_ms", "compute_infer_ms", "compute_output_ms"):
        values = [p[part] for p in first]
        ax.bar(range(len(first)), values, bottom=bottom, label=part.removesuffix("_ms"))
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_xticks(range(len(first)), labels, fontsize=6, rotation=90)
    ax.set_ylabel("ms per request (Triton statistics)")
    ax.set_title(f"where time goes ({run['protocols'][0]}, medians)")
    ax.legend(fontsize=7)
    for ax, system in zip(axes[0][1:], systems, strict=True):
        for p in first:
            if p["system"] == system and p.get("batch_sizes"):
                sizes = sorted(int(k) for k in p["batch_sizes"])
                ax.plot(sizes, [p["batch_sizes"][str(k)] for k in sizes], marker="o", linestyle="none",
                        label=f"{p['profile']} N={p['concurrency']}")
        ax.set_xlabel("batch size Triton handed the model")
        ax.set_ylabel("executions (all rounds)")
        ax.set_title(f"{system}: batch sizes")
        ax.legend(fontsize=7)
    paths.append(out_dir / f"{run['run']}-breakdown.png")
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def summarize(points: Sequence[Point]) -> list[dict[str, Any]]:
    """One point per (system, profile, protocol, concurrency), merged over rounds.

    Numeric fields become medians over the rounds; batch-size counts are summed.
    """
    groups: dict[tuple[Any, ...], list[Point]] = {}
    for p in points:
        groups.setdefault((p["system"], p["profile"], p["protocol"], p["concurrency"]), []).append(p)
    out = []
    for (system, profile, protocol, concurrency), members in groups.items():
        merged: dict[str, Any] = {"system": system, "profile": profile, "protocol": protocol,
                                  "concurrency": concurrency, "rounds": len(members)}
        for key, value in members[0].items():
            if isinstance(value, int | float) and key not in merged and key != "round":
                merged[key] = median([float(m[key]) for m in members if isinstance(m.get(key), int | float)])
        sizes: dict[str, int] = {}
        for m in members:
            for size, count in (m.get("batch_sizes") or {}).items():
                sizes[size] = sizes.get(size, 0) + int(count)
        merged["batch_sizes"] = sizes
        out.append(merged)
    return out

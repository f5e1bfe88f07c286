"""Builds the bench report: ratio table, cost per million inferences, and plots."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

Point = Mapping[str, Any]


def cost_per_million(throughput_per_s: float, price_per_hour: float) -> float:
    """Dollars per million inferences at ``throughput_per_s`` on an instance costing ``price_per_hour``."""
    if throughput_per_s <= 0:
        return float("inf")
    return price_per_hour / (throughput_per_s * 3600.0) * 1e6


def find(points: Sequence[Point], **match: Any) -> Point | None:
    """The first point whose fields equal ``match``."""
    for point in points:
        if all(point.get(k) == v for k, v in match.items()):
            return point
    return None


BASELINES = ("naive", "pytriton")


def ratio_rows(points: Sequence[Point], limits: Mapping[str, Mapping[str, Any]],
               protocol: str) -> list[dict[str, Any]]:
    """One row per (profile, concurrency): coalesce over each baseline, ``limit@N`` and ``limit``, with p99s.

    A baseline with no point there gives ``None`` in its columns.
    """
    rows = []
    for profile in sorted({p["profile"] for p in points}):
        for concurrency in sorted({p["concurrency"] for p in points if p["profile"] == profile}):
            ours = find(points, system="coalesce", profile=profile, concurrency=concurrency, protocol=protocol)
            if ours is None:
                continue
            ceiling = limits.get(profile, {})
            at_n = ceiling.get(f"limit@{concurrency}")
            row = {
                "profile": profile, "concurrency": concurrency, "protocol": protocol,
                "coalesce_per_s": ours["throughput_per_s"], "coalesce_p99_ms": ours["p99_ms"],
                "over_limit_at_n": ours["throughput_per_s"] / at_n if at_n else None,
                "over_limit": ours["throughput_per_s"] / ceiling["limit"] if ceiling.get("limit") else None,
            }
            for baseline in BASELINES:
                theirs = find(points, system=baseline, profile=profile, concurrency=concurrency, protocol=protocol)
                row[f"{baseline}_per_s"] = theirs["throughput_per_s"] if theirs else None
                row[f"{baseline}_p99_ms"] = theirs["p99_ms"] if theirs else None
                row[f"over_{baseline}"] = ours["throughput_per_s"] / theirs["throughput_per_s"] if theirs else None
            rows.append(row)
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
    lines = [f"# Bench run {run['run']}", "", f"- machine: {run['machine']}", f"- command: `{run['command']}`",
             f"- workloads: {run['workloads']}", f"- instance price: ${price}/hour", ""]
    for protocol in run["protocols"]:
        lines += [f"## Ratios ({protocol})", "",
                  "| profile | N | coalesce/s | p99 ms | naive/s | naive p99 ms | pytriton/s | pytriton p99 ms "
                  "| x naive | x pytriton | x limit@N | x limit |", "|" + " --- |" * 12]
        for r in ratio_rows(run["points"], run["limits"], protocol):
            cells = [r["profile"], str(r["concurrency"]), _fmt(r["coalesce_per_s"], 1), _fmt(r["coalesce_p99_ms"], 1)]
            for baseline in BASELINES:
                cells += [_fmt(r[f"{baseline}_per_s"], 1), _fmt(r[f"{baseline}_p99_ms"], 1)]
            cells += [_fmt(r["over_naive"]), _fmt(r["over_pytriton"]), _fmt(r["over_limit_at_n"]),
                      _fmt(r["over_limit"])]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["## Offline ceilings (texts/s)", "", "| profile | ceiling | texts/s |", "| --- | --- | --- |"]
    for profile, ceilings in sorted(run["limits"].items()):
        for name, value in ceilings.items():
            if isinstance(value, float):
                lines.append(f"| {profile} | {name} | {value:.1f} |")
    lines += ["", "## All points", "",
              "| system | profile | protocol | N | texts/s | p50 ms | p95 ms | p99 ms | queue ms | infer ms | "
              "avg batch | $/M inferences |", "|" + " --- |" * 12]
    for p in run["points"]:
        lines.append("| " + " | ".join([p["system"], p["profile"], p["protocol"], str(p["concurrency"]),
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

    points = run["points"]
    paths = []
    profiles = sorted({p["profile"] for p in points})
    fig, axes = plt.subplots(1, len(profiles), figsize=(6 * len(profiles), 4.5), squeeze=False)
    for ax, profile in zip(axes[0], profiles, strict=True):
        for system in sorted({p["system"] for p in points}):
            for protocol in run["protocols"]:
                series = sorted((p for p in points if p["system"] == system and p["profile"] == profile
                                 and p["protocol"] == protocol), key=lambda p: p["concurrency"])
                if series:
                    ax.plot([p["p99_ms"] for p in series], [p["throughput_per_s"] for p in series], marker="o",
                            label=f"{system} ({protocol})")
                    for p in series:
                        ax.annotate(str(p["concurrency"]), (p["p99_ms"], p["throughput_per_s"]), fontsize=7)
        for name, value in run["limits"].get(profile, {}).items():
            if name == "limit" and isinstance(value, float):
                ax.axhline(value, linestyle="--", color="grey", label="limit (offline)")
        ax.set_title(f"{profile}: throughput vs p99 (labels: concurrency)")
        ax.set_xlabel("p99 latency (ms)")
        ax.set_ylabel("texts/s")
        ax.legend(fontsize=7)
    paths.append(out_dir / f"{run['run']}-throughput.png")
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    grpc_points = [p for p in points if p["protocol"] == run["protocols"][0]]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    labels = [f"{p['system']}\n{p['profile'][:3]} N={p['concurrency']}" for p in grpc_points]
    parts = ("queue_ms", "compute_input_ms", "compute_infer_ms", "compute_output_ms")
    bottom = [0.0] * len(grpc_points)
    for part in parts:
        values = [p[part] for p in grpc_points]
        axes[0].bar(range(len(grpc_points)), values, bottom=bottom, label=part.removesuffix("_ms"))
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    axes[0].set_xticks(range(len(grpc_points)), labels, fontsize=6, rotation=90)
    axes[0].set_ylabel("ms per request (Triton statistics)")
    axes[0].set_title("where time goes")
    axes[0].legend(fontsize=7)
    for p in grpc_points:
        if p["system"] == "coalesce" and p.get("batch_sizes"):
            sizes = sorted(int(k) for k in p["batch_sizes"])
            axes[1].plot(sizes, [p["batch_sizes"][str(s)] for s in sizes], marker="o", linestyle="none",
                         label=f"{p['profile']} N={p['concurrency']}")
    axes[1].set_xlabel("batch size Triton handed the backend")
    axes[1].set_ylabel("executions")
    axes[1].set_title("coalesce: batch sizes")
    axes[1].legend(fontsize=7)
    paths.append(out_dir / f"{run['run']}-breakdown.png")
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths

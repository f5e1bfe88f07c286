"""The report of ``perf.peers``: per-profile tables of texts/s and p99, same-round ratios, a plot."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from perf.report import _by_round, _fmt, median

Point = Mapping[str, Any]
INFINITY = ("infinity-torch", "infinity-optimum", "infinity-optimum-int8")


def _ratio(ours: dict[int, Point], theirs: dict[int, Point]) -> float | None:
    """Median of the same-round throughput ratios ours / theirs."""
    return median([ours[r]["throughput_per_s"] / theirs[r]["throughput_per_s"] for r in ours
                   if r in theirs and theirs[r]["throughput_per_s"] > 0])


def ratio_rows(run: Mapping[str, Any], profile: str) -> list[dict[str, Any]]:
    """One row per concurrency: each system's median texts/s and p99, and coalesce's same-round ratios.

    ``over_best_infinity`` divides by the fastest Infinity engine of each round (the engines that
    loaded and passed the check); ``over_limit16`` is given at concurrency 16 only, and
    ``p50_over_bare`` (coalesce's p50 over in-process one-text latency) at concurrency 1 only.
    """
    points = [p for p in run["points"] if p["profile"] == profile]
    references = run.get("references", {}).get(profile, {})
    rows = []
    for concurrency in sorted({p["concurrency"] for p in points}):
        row: dict[str, Any] = {"concurrency": concurrency, "systems": {}}
        per_system = {s: _by_round(points, system=s, concurrency=concurrency) for s in run["systems"]}
        for system, by_round in per_system.items():
            if by_round:
                row["systems"][system] = {
                    "per_s": median([p["throughput_per_s"] for p in by_round.values()]),
                    "p50_ms": median([p["p50_ms"] for p in by_round.values() if p["p50_ms"] is not None]),
                    "p99_ms": median([p["p99_ms"] for p in by_round.values() if p["p99_ms"] is not None]),
                    "errors": sum(int(p["errors"]) for p in by_round.values())}
        ours = per_system.get("coalesce", {})
        row["over_infinity_torch"] = _ratio(ours, per_system.get("infinity-torch", {}))
        best: dict[int, Point] = {}
        for system in INFINITY:
            for r, p in per_system.get(system, {}).items():
                if r not in best or p["throughput_per_s"] > best[r]["throughput_per_s"]:
                    best[r] = p
        row["over_best_infinity"] = _ratio(ours, best)
        row["best_infinity"] = sorted({p["system"] for p in best.values()})
        row["over_rayserve"] = _ratio(ours, per_system.get("rayserve", {}))
        limit16 = references.get("limit@16", [])
        row["over_limit16"] = median([ours[r]["throughput_per_s"] / limit16[r] for r in ours
                                      if r < len(limit16) and limit16[r] > 0]) if concurrency == 16 else None
        bare = references.get("bare_p50_ms", [])
        row["p50_over_bare"] = median([ours[r]["p50_ms"] / bare[r] for r in ours
                                       if r < len(bare) and bare[r] > 0 and ours[r]["p50_ms"] is not None]
                                      ) if concurrency == 1 else None
        rows.append(row)
    return rows


#: Targets of the shipped server (issue "cores shared, not split"), and the concurrencies each is judged at.
SHIPPED_TARGETS: Final = {
    "over_alone": (0.9, (16, 64), "texts/s over `coalesce` (minilm alone in its server, every core)"),
    "p50_over_alone": (1.2, (1,), "c=1 p50 over `coalesce`'s (at most)"),
    "over_infinity_torch": (2.5, (16, 64), "texts/s over `infinity-torch`"),
    "int8_over_fp32": (1.5, (16,), "`coalesce-shipped-int8`'s texts/s over `coalesce-shipped-fp32`'s (INT8 over FP32)"),
}


def _same_round(ours: dict[int, Point], theirs: dict[int, Point], key: str) -> float | None:
    """Median of the same-round ratios ours / theirs of ``key``."""
    return median([ours[r][key] / theirs[r][key] for r in ours
                   if r in theirs and ours[r][key] is not None and theirs[r][key]])


def shipped_rows(run: Mapping[str, Any], profile: str) -> list[dict[str, Any]]:
    """``coalesce-shipped`` (the example repository as shipped, every model loaded) against its targets, per c."""
    points = [p for p in run["points"] if p["profile"] == profile]
    bare = run.get("references", {}).get(profile, {}).get("bare_p50_ms", [])
    rows = []
    for concurrency in sorted({p["concurrency"] for p in points}):
        by = {s: _by_round(points, system=s, concurrency=concurrency) for s in run["systems"]}
        shipped = by.get("coalesce-shipped", {})
        if not shipped:
            continue
        infinity = by.get("infinity-torch", {})
        rows.append({
            "concurrency": concurrency,
            "over_alone": _same_round(shipped, by.get("coalesce", {}), "throughput_per_s"),
            "p50_over_alone": _same_round(shipped, by.get("coalesce", {}), "p50_ms") if concurrency == 1 else None,
            "p50_over_bare": median([shipped[r]["p50_ms"] / bare[r] for r in shipped if r < len(bare) and bare[r]])
            if concurrency == 1 else None,
            "over_infinity_torch": _same_round(shipped, infinity, "throughput_per_s"),
            "p99_over_infinity_torch": _same_round(shipped, infinity, "p99_ms"),
            "int8_over_fp32": _same_round(by.get("coalesce-shipped-int8", {}), by.get("coalesce-shipped-fp32", {}),
                                          "throughput_per_s"),
        })
    return rows


def _verdict(key: str, row: Mapping[str, Any]) -> str:
    value = row.get(key)
    if value is None:
        return "-"
    target, judged_at, _ = SHIPPED_TARGETS[key]
    if row["concurrency"] not in judged_at:
        return f"{value:.2f}"
    met = value <= target if key.startswith("p50") else value >= target
    return f"{value:.2f} ({'met' if met else 'missed'})"


def shipped_markdown(run: Mapping[str, Any], profile: str) -> list[str]:
    """The shipped server's section of the report (empty when it was not measured)."""
    rows = shipped_rows(run, profile)
    if not rows:
        return []
    lines = ["### The shipped server (every example model loaded; load on minilm alone, row cache off)", "",
             "Targets: " + "; ".join(f"{text} >= {target} at c = {', '.join(map(str, at))}"
                                     .replace(">= ", "<= " if key.startswith("p50") else ">= ")
                                     for key, (target, at, text) in SHIPPED_TARGETS.items()) + ".", "",
             "| c | x coalesce (alone) | c=1 p50 / coalesce p50 | c=1 p50 / bare p50 | x infinity-torch "
             "| p99 / infinity-torch p99 | INT8 / FP32 |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        lines.append(f"| {row['concurrency']} | {_verdict('over_alone', row)} | {_verdict('p50_over_alone', row)} | "
                     f"{_fmt(row['p50_over_bare'])} | {_verdict('over_infinity_torch', row)} | "
                     f"{_fmt(row['p99_over_infinity_torch'])} | {_verdict('int8_over_fp32', row)} |")
    return [*lines, ""]


def markdown(run: Mapping[str, Any]) -> str:
    """The report as Markdown."""
    systems = [s for s in run["systems"] if run["checks"].get(s, {}).get("ok")]
    lines = [f"# Peers run {run['run']}", "",
             f"- machine: {run['machine']}; every system running at once, measured one at a time",
             f"- command: `{run['command']}`",
             f"- workloads: {run['workloads']}",
             f"- load: one closed-loop HTTP generator (`perf/closed_loop.py`, asyncio + aiohttp), one text per "
             f"request; {run['warmup_s']:g} s warm-up then {run['duration_s']:g} s per point",
             f"- rounds: {run['rounds']}; every round measures each profile and concurrency for every system in "
             "turn; texts/s and p99 are medians over rounds, ratios medians of same-round ratios",
             f"- raw per-request data: `{run['raw']}/requests.csv` (not committed)", ""]
    for profile in run["profiles"]:
        rows = ratio_rows(run, profile)
        lines += [f"## {profile}", "", "texts/s (p99 ms)", "",
                  "| c | " + " | ".join(systems) + " |", "|" + " --- |" * (len(systems) + 1)]
        for row in rows:
            cells = [str(row["concurrency"])]
            for system in systems:
                got = row["systems"].get(system)
                cells.append("-" if got is None else
                             f"{_fmt(got['per_s'], 1)} ({_fmt(got['p99_ms'], 1)})"
                             + (f", {got['errors']} errors" if got["errors"] else ""))
            lines.append("| " + " | ".join(cells) + " |")
        lines += ["", "| c | x infinity-torch | x best infinity | x rayserve | x limit@16 | c=1 p50 / bare p50 |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for row in rows:
            best = ", ".join(row["best_infinity"]) or "-"
            lines.append(f"| {row['concurrency']} | {_fmt(row['over_infinity_torch'])} | "
                         f"{_fmt(row['over_best_infinity'])} ({best}) | {_fmt(row['over_rayserve'])} | "
                         f"{_fmt(row['over_limit16'])} | {_fmt(row['p50_over_bare'])} |")
        lines += ["", *shipped_markdown(run, profile)]
        refs = run.get("references", {}).get(profile, {})
        if refs:
            lines += ["", f"In process (median over rounds): bare one text {_fmt(median(refs['bare_mean_ms']))} ms "
                      f"mean, {_fmt(median(refs['bare_p50_ms']))} ms p50; limit@16 "
                      f"{_fmt(median(refs['limit@16']), 1)} texts/s."]
        lines.append("")
    lines += ["## Checks (cosine to coalesce-fp32's vectors)", "",
              "| system | ok | min cosine | longest text's cosine | error |", "| --- | --- | --- | --- | --- |"]
    for system in run["systems"]:
        c = run["checks"].get(system, {})
        error = str(c.get("error", "")).replace("\n", " ").replace("|", "/")[:300]
        lines.append(f"| {system} | {'yes' if c.get('ok') else 'NO'} | {_fmt(c.get('min_cosine'), 4)} | "
                     f"{_fmt(c.get('long_text_cosine'), 4)} | {error} |")
    lines += ["", "## Versions", ""]
    for env, packages in run["versions"].items():
        lines.append(f"- {env}: " + ", ".join(f"{k} {v}" for k, v in packages.items()))
    if run.get("notes"):
        lines += ["", "## Notes", ""] + [f"- {k}: {v}" for k, v in run["notes"].items()]
    lines += ["", f"Plot: `{run.get('plot', '')}`", ""]
    return "\n".join(lines)


def plot(run: Mapping[str, Any], path: Path) -> Path:
    """Throughput and p99 against concurrency, per system, one row per profile; a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    profiles: Sequence[str] = run["profiles"]
    fig, axes = plt.subplots(len(profiles), 2, figsize=(12, 4.2 * len(profiles)), squeeze=False)
    for (throughput_ax, p99_ax), profile in zip(axes, profiles, strict=True):
        rows = ratio_rows(run, profile)
        for index, system in enumerate(run["systems"]):
            series = [(r["concurrency"], r["systems"][system]) for r in rows if system in r["systems"]]
            if not series:
                continue
            style = {"marker": "o", "color": f"C{index}", "label": system,
                     "linewidth": 2.5 if system.startswith("coalesce") else 1.2}
            throughput_ax.plot([c for c, _ in series], [s["per_s"] for _, s in series], **style)
            p99_ax.plot([c for c, _ in series], [s["p99_ms"] for _, s in series], **style)
        for ax, label in ((throughput_ax, "texts/s (median over rounds)"), (p99_ax, "p99 ms (median over rounds)")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrent requests (closed loop)")
            ax.set_ylabel(label)
            ax.set_title(f"{profile}: {label.split(' ')[0]}")
            ax.legend(fontsize=7)
        p99_ax.set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

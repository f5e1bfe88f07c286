"""Per-request outcomes of a load run: tenants drawn by share, goodput and refusals (pure, no gevent)."""

from __future__ import annotations

import dataclasses
import random
from typing import Any


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (nearest rank) of ``values``; 0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclasses.dataclass(frozen=True)
class Outcome:
    """One request: when it was sent (s into the run), its tenant, latency and result (ok/rejected/error)."""

    sent_s: float
    tenant: str
    latency_ms: float
    result: str


def parse_shares(text: str) -> dict[str, float]:
    """``'a:10,b:1'`` -> ``{'a': 10.0, 'b': 1.0}``.

    Raises:
        ValueError: On an entry that is not ``name:positive number``.
    """
    shares: dict[str, float] = {}
    for entry in (e.strip() for e in text.split(",") if e.strip()):
        name, _, value = entry.rpartition(":")
        if not name or not value.replace(".", "", 1).isdigit() or float(value) <= 0:
            raise ValueError(f"--tenants entry '{entry}' is not 'name:positive share'")
        shares[name] = float(value)
    return shares


def assign_tenants(count: int, shares: dict[str, float], seed: int) -> list[str]:
    """A tenant for each of ``count`` arrivals, drawn by share with a seeded generator."""
    if not shares:
        return []
    rng = random.Random(seed + 1)
    names = list(shares)
    return rng.choices(names, weights=[shares[n] for n in names], k=count)


def summarize_outcomes(outcomes: list[Outcome], duration_s: float, target_ms: float) -> dict[str, Any]:
    """Goodput (answers within ``target_ms`` per second of schedule), refusals, and the same per tenant."""
    def block(items: list[Outcome]) -> dict[str, Any]:
        ok = sorted(o.latency_ms for o in items if o.result == "ok")
        good = sum(1 for v in ok if not target_ms or v <= target_ms)
        return {"sent": len(items), "ok": len(ok), "rejected": sum(o.result == "rejected" for o in items),
                "errors": sum(o.result == "error" for o in items),
                "goodput_per_s": round(good / duration_s, 2) if duration_s else 0.0,
                "ok_p50_ms": round(percentile(ok, 0.5), 2) if ok else 0.0,
                "ok_p99_ms": round(percentile(ok, 0.99), 2) if ok else 0.0,
                "within_target": round(good / len(items), 4) if items else 0.0}

    summary = block(outcomes)
    tenants = sorted({o.tenant for o in outcomes if o.tenant})
    if tenants:
        summary["tenants"] = {t: block([o for o in outcomes if o.tenant == t]) for t in tenants}
    return summary



"""Seeded workloads of real English text for perf_analyzer, Locust and the offline ceilings.

The text is the prose of Python's own reference documentation (``pydoc_data.topics``,
shipped with every CPython), cut into sentences, so no download is needed and the
same seed gives the same workload everywhere. Profiles:

- ``queries``: 3 to 16 words, like search queries.
- ``documents``: mostly short snippets and sentences, with a long tail of passages past 128 tokens.
- ``duplicates``: Zipf-distributed draws over a small set of queries (for caching work).
- ``mixed``: a bulk corpus of mixed lengths: mostly queries, some sentences, and a thin tail
  of passages past the model's 256 tokens.

Written as perf_analyzer ``--input-data`` JSON: ``{"data": [{"TEXT": {"content": [...], "shape": [1]}}, ...]}``.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from collections.abc import Callable, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Final

PROFILES: Final = ("queries", "documents", "duplicates", "mixed")
_SENTENCE_END: Final = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
_PROSE_CHARS: Final = re.compile(r"[A-Za-z ,.;:'()?!-]")


@lru_cache(maxsize=1)
def sentences() -> tuple[str, ...]:
    """English sentences from the Python reference documentation, in a fixed order."""
    from pydoc_data.topics import topics

    out: list[str] = []
    for key in sorted(topics):
        for paragraph in re.split(r"\n\s*\n", topics[key]):
            lines = paragraph.splitlines()
            # Indented blocks are code or grammar; keep flowing prose only.
            if not lines or any(line.startswith((" ", "\t", ">>>", "*")) for line in lines):
                continue
            text = " ".join(line.strip() for line in lines)
            for sentence in _SENTENCE_END.split(text):
                words = sentence.split()
                prose = sum(bool(_PROSE_CHARS.fullmatch(ch)) for ch in sentence) / max(len(sentence), 1)
                if len(words) >= 4 and prose > 0.95:
                    out.append(" ".join(words))
    return tuple(out)


def _distinct(make: Callable[[random.Random], str], count: int, rng: random.Random) -> list[str]:
    seen: set[str] = set()
    texts: list[str] = []
    attempts = 0
    while len(texts) < count:
        attempts += 1
        if attempts > count * 50:
            raise ValueError(f"cannot make {count} distinct texts from the corpus")
        text = make(rng)
        if text not in seen:
            seen.add(text)
            texts.append(text)
    return texts


def queries(count: int, seed: int = 0) -> list[str]:
    """``count`` distinct queries of 3 to 16 words."""
    corpus = sentences()

    def make(rng: random.Random) -> str:
        words = rng.choice(corpus).split()
        size = rng.randint(3, 16)
        start = rng.randint(0, max(0, len(words) - size))
        return " ".join(words[start:start + size]).rstrip(".,;:")

    return _distinct(make, count, random.Random(f"queries-{seed}"))


def documents(count: int, seed: int = 0) -> list[str]:
    """``count`` distinct passages: 70% short snippets, 20% of 1 to 3 sentences, 10% of 4 to 20."""
    corpus = sentences()

    def make(rng: random.Random) -> str:
        start = rng.randrange(len(corpus))
        roll = rng.random()
        if roll < 0.7:  # a title, a snippet or a short sentence
            words = corpus[start].split()
            return " ".join(words[:rng.randint(4, 30)])
        size = rng.randint(1, 3) if roll < 0.9 else rng.randint(4, 20)  # paragraphs; the tail past 128 tokens
        return " ".join(corpus[(start + i) % len(corpus)] for i in range(size))

    return _distinct(make, count, random.Random(f"documents-{seed}"))


def mixed(count: int, seed: int = 0) -> list[str]:
    """``count`` distinct texts: 80% queries of 3-16 words, 15% a sentence, 4% 2-4, 1% 5-12 (past 256 tokens)."""
    corpus = sentences()

    def make(rng: random.Random) -> str:
        start = rng.randrange(len(corpus))
        roll = rng.random()
        if roll < 0.8:
            words = corpus[start].split()
            size = rng.randint(3, 16)
            first = rng.randint(0, max(0, len(words) - size))
            return " ".join(words[first:first + size]).rstrip(".,;:")
        size = 1 if roll < 0.95 else rng.randint(2, 4) if roll < 0.99 else rng.randint(5, 12)
        return " ".join(corpus[(start + i) % len(corpus)] for i in range(size))

    return _distinct(make, count, random.Random(f"mixed-{seed}"))


def duplicates(count: int, seed: int = 0, unique: int = 200, exponent: float = 1.1) -> list[str]:
    """``count`` draws, Zipf over ``unique`` distinct queries (rank r drawn with weight r^-exponent)."""
    pool = queries(unique, seed)
    weights = [1.0 / (rank ** exponent) for rank in range(1, unique + 1)]
    return random.Random(f"duplicates-{seed}").choices(pool, weights=weights, k=count)


def generate(profile: str, count: int, seed: int = 0) -> list[str]:
    """Texts of one profile."""
    if profile == "queries":
        return queries(count, seed)
    if profile == "documents":
        return documents(count, seed)
    if profile == "duplicates":
        return duplicates(count, seed)
    if profile == "mixed":
        return mixed(count, seed)
    raise ValueError(f"unknown profile {profile!r}; expected one of {', '.join(PROFILES)}")


def to_input_data(texts: Sequence[str], input_name: str = "TEXT") -> dict[str, list[dict[str, dict[str, object]]]]:
    """perf_analyzer ``--input-data`` JSON: one request of one text per entry."""
    return {"data": [{input_name: {"content": [t], "shape": [1]}} for t in texts]}


def write(profile: str, count: int, seed: int, out: Path) -> Path:
    """Write one profile's input-data file."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(to_input_data(generate(profile, count, seed)), ensure_ascii=False))
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m perf.workloads --profile documents --count 4000 --seed 0 --out FILE``."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", choices=PROFILES, required=True)
    parser.add_argument("--count", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    write(args.profile, args.count, args.seed, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

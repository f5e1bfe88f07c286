"""TensorRT optimization profiles, derived from a model's config, and matching a pass to one.

An engine is built for ranges of input shapes (``rows x tokens``); each range is a
profile with a min, an optimum (what TensorRT tunes its kernels for) and a max. We cut
the token axis into length buckets (short queries should not run kernels tuned for 256
tokens) and span rows from 1 to the model's row limit, with the largest preferred
batch size as the optimum. At run time each sub-batch goes to the tightest profile that
holds it, and the coalescer never plans a pass that no profile holds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Final

#: Default upper bounds of the token-length buckets (the last is the model's max sequence length).
DEFAULT_LENGTH_BUCKETS: Final = (32, 128)


@dataclasses.dataclass(frozen=True)
class Profile:
    """One optimization profile: rows and tokens ranges, with the shapes TensorRT tunes for."""

    min_rows: int
    opt_rows: int
    max_rows: int
    min_length: int
    opt_length: int
    max_length: int

    def holds(self, rows: int, length: int) -> bool:
        """Whether a pass of ``rows`` x ``length`` fits this profile."""
        return self.min_rows <= rows <= self.max_rows and self.min_length <= length <= self.max_length

    def shapes(self) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
        """``(min, opt, max)`` input shapes, as TensorRT's ``set_shape`` takes them."""
        return ((self.min_rows, self.min_length), (self.opt_rows, self.opt_length), (self.max_rows, self.max_length))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Profile:
        """Inverse of ``dataclasses.asdict``."""
        return cls(**{f.name: int(data[f.name]) for f in dataclasses.fields(cls)})


def derive_profiles(*, max_rows: int, max_length: int, preferred_rows: Sequence[int] = (),
                    length_buckets: Sequence[int] = DEFAULT_LENGTH_BUCKETS) -> list[Profile]:
    """Profiles covering ``1..max_rows`` rows and ``1..max_length`` tokens, one per length bucket.

    The optimum rows is the largest preferred batch size within the limit (else the
    limit); the optimum length is the bucket's top.

    Raises:
        ValueError: If a limit is below 1.
    """
    if max_rows < 1 or max_length < 1:
        raise ValueError(f"profiles need max_rows and max_length >= 1, got {max_rows} and {max_length}")
    opt_rows = max([r for r in preferred_rows if 1 <= r <= max_rows], default=max_rows)
    tops = sorted({b for b in length_buckets if 1 <= b < max_length} | {max_length})
    profiles = []
    low = 1
    for top in tops:
        profiles.append(Profile(1, opt_rows, max_rows, low, top, top))
        low = top + 1
    return profiles


def match_profile(profiles: Sequence[Profile], rows: int, length: int) -> int | None:
    """Index of the tightest profile (smallest max length, then max rows) holding the pass, or None."""
    fits = [i for i, p in enumerate(profiles) if p.holds(rows, length)]
    if not fits:
        return None
    return min(fits, key=lambda i: (profiles[i].max_length, profiles[i].max_rows))


def plan_limits(profiles: Sequence[Profile]) -> tuple[int, int]:
    """``(rows, length)`` the coalescer must stay within so every pass fits some profile.

    Profiles from ``derive_profiles`` share their row range and tile the lengths, so the
    smallest max rows and the largest max length are exact.
    """
    return min(p.max_rows for p in profiles), max(p.max_length for p in profiles)

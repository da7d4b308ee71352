"""Where a search's time goes: named stages timed with a wall clock, so a user can see what to cut
(fewer layers to profile, fewer trials, shorter timing) and we can see which repeated work to keep out."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping


class Stopwatch:
    """Seconds and counts per named stage, accumulated over any number of `section` blocks."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.counts: dict[str, int] = {}

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start)

    def add(self, name: str, seconds: float, count: int = 1) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        self.counts[name] = self.counts.get(name, 0) + count

    def count(self, name: str, n: int = 1) -> None:
        """A count with no time of its own (work avoided, for example)."""
        self.counts[name] = self.counts.get(name, 0) + n

    def merge(self, other: Mapping[str, Mapping[str, float]] | None) -> None:
        """Add another stopwatch's `to_dict()` (the profile's, for example) to this one."""
        other = other or {}
        seconds, counts = other.get("seconds", {}), other.get("counts", {})
        for name, s in seconds.items():
            self.add(name, float(s), int(counts.get(name, 1)))
        for name, n in counts.items():
            if name not in seconds:
                self.count(name, int(n))

    def to_dict(self) -> dict[str, dict[str, float]]:
        return {"seconds": {k: round(v, 3) for k, v in self.seconds.items()}, "counts": dict(self.counts)}


def cost_rows(cost: Mapping[str, Mapping[str, float]]) -> list[list[object]]:
    """[stage, seconds, share of the total, count] rows, in the order the stages ran, then their total, then
    what was counted but took no time of its own (work avoided)."""
    seconds, counts = cost.get("seconds", {}), cost.get("counts", {})
    total = sum(seconds.values())
    rows: list[list[object]] = []
    for name, s in seconds.items():
        rows.append([name, f"{s:.1f}", f"{100 * s / total:.0f}%" if total > 0 else "-", counts.get(name, "")])
    if seconds:
        rows.append(["total of the stages above", f"{total:.1f}", "100%", ""])
    for name, n in counts.items():
        if name not in seconds:
            rows.append([name, "-", "-", n])
    return rows

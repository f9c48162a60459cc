"""Power of two choices: of two replicas drawn at random, the less loaded one. Replicas that
are full (they refused a moment ago) are taken only when no other is left."""

from __future__ import annotations

import random
from collections.abc import Collection, Sequence

from lockgate.router.replica import Replica


class Balancer:
    def __init__(self, seed: int | None = None) -> None:
        self.random = random.Random(seed)

    def pick(
        self, replicas: Sequence[Replica], now: float, exclude: Collection[Replica] = ()
    ) -> Replica | None:
        usable = [r for r in replicas if r.usable(now) and r not in exclude]
        open_ = [r for r in usable if not r.full(now)]
        return self.choose(open_ or usable) if usable else None

    def choose(self, choices: Sequence[Replica]) -> Replica:
        """Of `choices` (not empty, each usable), the less loaded of two drawn at random."""
        if len(choices) == 1:
            return choices[0]
        a, b = self.random.sample(choices, 2)
        if a.load != b.load:
            return a if a.load < b.load else b
        return a

"""Where a language-model request goes (`--llm-routing`): /v1/completions and
/v1/chat/completions.

- `least-load` (default): the replica with the fewest requests in progress, ties at random.
- `prefix`: the start of the prompt (`--prefix-chars` characters of the prompt, or of the
  messages rendered as `role\\ncontent\\n`, after the model's name) ranks the replicas by
  rendezvous hashing. The request goes to the first replica in that order whose load is at most
  the least loaded replica's plus `--prefix-load-margin`. Requests that share a prefix (a system
  prompt, few-shot examples) land on one replica, whose prefix cache then holds it, unless that
  replica is busier than the others by more than the margin. The least loaded replica always
  qualifies, so a hot prefix spills over to its next choice instead of queueing. No state is
  kept, so several routers send a prefix to the same replica.

Load is the one balancing compares: the router's requests in progress on the replica, or what
the replica last reported, if more.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from lockgate.core.metrics import Registry
from lockgate.router import rendezvous
from lockgate.router.replica import Replica

Mode = Literal["least-load", "prefix"]
MODES: tuple[Mode, ...] = ("least-load", "prefix")


@dataclass(frozen=True, slots=True)
class LLMRoutingSettings:
    mode: Mode = "least-load"
    prefix_chars: int = 512  # characters of the prompt that choose the replica
    load_margin: int = 4  # requests in progress above the least loaded replica's

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"--llm-routing must be one of {', '.join(MODES)}")
        if self.prefix_chars < 1:
            raise ValueError("--prefix-chars must be at least 1")
        if self.load_margin < 0:
            raise ValueError("--prefix-load-margin must be at least 0")


class LLMRouting:
    def __init__(
        self, settings: LLMRoutingSettings, registry: Registry, rng: random.Random | None = None
    ) -> None:
        self.settings = settings
        self.random = rng or random.Random()
        self.choices = registry.counter(
            "lockgate_router_llm_routing_total",
            "Language-model requests by how their replica was chosen: 'least-load', 'prefix' "
            "(the prefix's first choice) or 'spilled' (a later choice: the first was too busy).",
            ("choice",),
        )

    def pick(self, prefix: bytes, candidates: Sequence[Replica]) -> Replica | None:
        if not candidates:
            return None
        least = min(r.load for r in candidates)
        if self.settings.mode == "least-load":
            self.choices.inc(("least-load",))
            return self.random.choice([r for r in candidates if r.load == least])
        ranked = rendezvous.ranked(prefix, candidates)
        chosen = next(r for r in ranked if r.load <= least + self.settings.load_margin)
        self.choices.inc(("prefix" if chosen is ranked[0] else "spilled",))
        return chosen

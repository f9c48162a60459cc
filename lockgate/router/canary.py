"""Canaries by weight (`--canary`). A rule gives a share of one model's requests, in percent as
KServe's `canaryTrafficPercent`, to a version or to a replica group:

- `digits:2=10`: 10% of the unversioned v2 inference requests for `digits`
  (`POST /v2/models/digits/infer`, `generate`, `generate_stream`) go to
  `/v2/models/digits/versions/2/...`; the rest keep the unversioned path. An OpenAI request
  (`/v1/completions`, `/v1/chat/completions`, `/v1/embeddings`) whose body's `model` names
  `digits` is sent with the header `x-lockgate-model-version: 2` instead, which the replica
  serves at that version.
- `smollm:#canary=5`: 5% of every inference request for `smollm` (v2, and the OpenAI routes whose
  body names it) go to the replicas labelled `#canary` (`--replica URL#canary`); the rest go to
  the main replicas.

Several rules of one model split its traffic as Envoy's weighted clusters do, at most 100% in
all (`digits:1=90 --canary digits:2=10` pins every request to a version). One draw per request
picks the rule. A request the drawn rule cannot apply to (a version rule and a request that
already names a version, in its path or in the header) stays where it was, so each rule's share
is its percent of the requests it can apply to.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from lockgate.router.groups import check_label


@dataclass(frozen=True, slots=True)
class CanaryRule:
    model: str
    percent: float  # 0..100
    version: str | None = None  # send to this version's path
    group: str | None = None  # send to the replicas labelled with this group

    @classmethod
    def parse(cls, text: str) -> CanaryRule:
        """`MODEL:VERSION=PERCENT` or `MODEL:#GROUP=PERCENT`."""
        head, eq, share = text.rpartition("=")
        model, colon, target = head.rpartition(":")
        if not eq or not colon or not model or not target:
            raise ValueError(
                f"--canary {text!r}: give MODEL:VERSION=PERCENT or MODEL:#GROUP=PERCENT"
            )
        percent = parse_percent(share, f"--canary {text!r}")
        if target.startswith("#"):
            return cls(model, percent, group=check_label(target[1:], f"--canary {text!r}"))
        if not (target.isascii() and target.isdigit()) or int(target) < 1:
            raise ValueError(f"--canary {text!r}: a version is a positive whole number")
        return cls(model, percent, version=str(int(target)))


def parse_percent(text: str, option: str) -> float:
    try:
        percent = float(text.rstrip("%"))
    except ValueError:
        raise ValueError(f"{option}: {text!r} is not a percent (0 to 100)") from None
    if not (math.isfinite(percent) and 0 <= percent <= 100):
        raise ValueError(f"{option}: the share must be a percent from 0 to 100, not {text}")
    return percent


class Canary:
    def __init__(self, rules: Sequence[CanaryRule], rng: random.Random | None = None) -> None:
        self.rules: dict[str, list[CanaryRule]] = {}
        for rule in rules:
            self.rules.setdefault(rule.model, []).append(rule)
        for model, listed in self.rules.items():
            total = sum(r.percent for r in listed)
            if total > 100 + 1e-9:
                raise ValueError(
                    f"--canary: the shares of {model!r} add up to {total:g}%, over 100"
                )
        self.random = rng or random.Random()

    def choose(self, model: str, can_version: bool) -> CanaryRule | None:
        """The rule this request goes by, or None: it stays where it was. `can_version`: it
        names no version yet (in its v2 path, or in the OpenAI routes' version header)."""
        rules = self.rules.get(model)
        if not rules:
            return None
        draw = self.random.random() * 100
        for rule in rules:
            draw -= rule.percent
            if draw < 0:
                return rule if rule.group is not None or can_version else None
        return None

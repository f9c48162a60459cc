"""Inference requests counted by model, version, replica group and status: what a canary is
judged by. An answer 404 (no such model or version) makes no series, and at most `max_models`
model names get series of their own; later ones are counted as `_other`."""

from __future__ import annotations

from lockgate.core.metrics import LabelValues, Registry
from lockgate.router.groups import MAIN
from lockgate.router.tally import Tally

OTHER = "_other"


class ModelCounts:
    def __init__(self, registry: Registry, max_models: int) -> None:
        self.max_models = max_models
        self.models: set[str] = set()
        self.requests = Tally(
            registry.counter(
                "lockgate_router_model_requests_total",
                "Inference requests by model, version ('latest' when the path, or the OpenAI "
                "routes' x-lockgate-model-version header, names none), replica group ('main' or a "
                "label) and status.",
                ("model", "version", "group", "status"),
            )
        )

    def count(self, model: str, version: str | None, group: str, status: int) -> None:
        labels = self.labels(model, version, group, status)
        if labels is not None:
            self.requests.inc(labels)

    def labels(
        self, model: str, version: str | None, group: str, status: int
    ) -> LabelValues | None:
        """The series an answer counts on (None: none, for a 404); a model past
        `max_models` counts as `_other`."""
        if status == 404:
            return None
        if model not in self.models:
            if len(self.models) >= self.max_models:
                model = OTHER
            else:
                self.models.add(model)
        return (model, version or "latest", group if group != MAIN else "main", str(status))

"""Triton's `reshape`, as a pass around a backend: clients send and get each tensor's `dims`,
the model takes and gives its `reshape`. A Triton repository whose ONNX model takes [B, 4]
while clients send [B, 2, 2], or gives a label of shape [B] where the config says [1]
(`dims: [1] reshape: { shape: [] }`), serves unchanged.

Both shapes hold the same elements in the same order, so a reshape is a view: the batcher
concatenates and splits rows in the clients' shapes, and the model never sees them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import numpy as np

from lockgate.backends.base import Answer, Backend, BatchedRequest, RequestBackend, RequestView
from lockgate.config import ModelConfig
from lockgate.datatypes import Arrays
from lockgate.errors import BackendError, BadRequest, ServingError


class Reshaped:
    """A backend whose configured inputs are reshaped to the model's shapes before each batch,
    and outputs back to the clients' after it."""

    __slots__ = ("_backend", "_batching", "_inputs", "_model", "_outputs", "finite_inputs")

    def __init__(self, backend: Backend, config: ModelConfig) -> None:
        self._backend = backend
        self._model = config.name
        self._batching = config.batching
        # name -> the row's shape to give (batch dim excluded when batching)
        self._inputs = {s.name: s.reshape for s in config.inputs if s.reshape is not None}
        self._outputs = {s.name: s.dims for s in config.outputs if s.reshape is not None}
        self.finite_inputs = bool(getattr(backend, "finite_inputs", False))

    @property
    def inline_safe(self) -> bool:
        return bool(getattr(self._backend, "inline_safe", False))

    @property
    def per_request(self) -> bool:
        return bool(getattr(self._backend, "per_request", False))

    def infer(self, inputs: Arrays) -> Arrays:
        return self._given(self._backend.infer(self._taken(inputs)))

    def infer_requests(self, requests: Sequence[BatchedRequest]) -> list[Answer]:
        """Each request reshaped on its own, for a backend that takes them so."""
        backend = cast(RequestBackend, self._backend)
        shaped: list[BatchedRequest] = []
        refused: dict[int, ServingError] = {}
        for index, request in enumerate(requests):
            try:
                shaped.append(RequestView.of(request, self._taken(request.inputs)))
            except BadRequest as exc:
                refused[index] = exc
        answers = iter(backend.infer_requests(shaped) if shaped else [])
        given: list[Answer] = []
        for index in range(len(requests)):
            answer = refused.get(index) or next(answers)
            if not isinstance(answer, ServingError):
                try:
                    answer = self._given(answer)
                except BackendError as exc:
                    answer = exc
            given.append(answer)
        return given

    def _taken(self, inputs: Arrays) -> Arrays:
        """The inputs in the model's shapes; BadRequest for one that has too few elements."""
        shaped = {}
        for name, array in inputs.items():
            try:
                shaped[name] = self._shaped(array, self._inputs.get(name))
            except ValueError:
                raise BadRequest(self._problem("input", name, array)) from None
        return shaped

    def _given(self, outputs: Arrays) -> Arrays:
        """The outputs in the clients' shapes."""
        given = {}
        for name, array in outputs.items():
            try:
                given[name] = self._shaped(array, self._outputs.get(name))
            except ValueError:
                raise BackendError(self._problem("output", name, array)) from None
        return given

    def _shaped(self, array: np.ndarray, row: tuple[int, ...] | None) -> np.ndarray:
        if row is None:
            return array
        # batching: array [B, *from] -> [B, *row]; else the whole tensor is one row
        return array.reshape((array.shape[0], *row) if self._batching else row)

    def _problem(self, kind: str, name: str, array: np.ndarray) -> str:
        wanted = self._inputs.get(name) if kind == "input" else self._outputs.get(name)
        return (
            f"model '{self._model}': {kind} '{name}' of shape {list(array.shape)} "
            f"cannot be reshaped to {list(wanted or ())} per row"
        )

    def close(self) -> None:
        self._backend.close()

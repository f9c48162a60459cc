"""The scikit-learn backend: a fitted estimator saved with joblib.

SECURITY: a joblib or pickle file is code. Loading one runs whatever it was made to run.
This backend loads `model.joblib` (or `model.pkl`, or `default_model_filename`) only from
inside the version folder, but it cannot make an untrusted file safe: serve only model
repositories you trust as you trust your own source code.

Inputs: one 2-D input `[batch, features]`. Outputs are matched to estimator methods by
name:

    label, output_label, predict                  -> predict(x)            [batch]
    probabilities, output_probability, predict_proba  -> predict_proba(x)  [batch, classes]
    decision_function, scores                     -> decision_function(x)
    transform                                     -> transform(x)

`parameters.method` names the method of a single output whose name is none of these. With
no outputs declared, the model returns `label` (or the output of `parameters.method`).

A config that declares no inputs and no outputs is completed from the estimator
(`autocomplete`): one FP64 input `input` of `n_features_in_` values, and one output, a
classifier's `label` or any other estimator's `predict`, with the datatype and the values per
row of `predict` on one row of zeros (FP64, one value per row, when it refuses zeros).

When both `predict` and `predict_proba` are asked of an estimator whose `predict` is by
definition the class of highest probability (trees, forests, extra trees, histogram
gradient boosting), the labels are taken from the probabilities: one pass over the model
instead of two, which halves the cost of a forest.
"""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import joblib
import numpy as np

from lockgate.backends.base import Arrays, model_file
from lockgate.config import ModelConfig, TensorSpec
from lockgate.datatypes import datatype_of, numpy_dtype
from lockgate.errors import BackendError, BadRequest, ConfigError

_METHOD_BY_NAME = {
    "label": "predict",
    "output_label": "predict",
    "predict": "predict",
    "probabilities": "predict_proba",
    "output_probability": "predict_proba",
    "predict_proba": "predict_proba",
    "decision_function": "decision_function",
    "scores": "decision_function",
    "transform": "transform",
}
_DEFAULT_OUTPUT = {"predict": "label", "predict_proba": "probabilities"}
# Estimators whose predict() is classes_[argmax(predict_proba())], by their class names
# (sklearn's ForestClassifier.predict, DecisionTreeClassifier.predict and
# HistGradientBoostingClassifier.predict are written that way).
_PREDICT_IS_ARGMAX = frozenset(
    {
        "RandomForestClassifier",
        "ExtraTreesClassifier",
        "DecisionTreeClassifier",
        "ExtraTreeClassifier",
        "HistGradientBoostingClassifier",
    }
)


def predict_from_proba(estimator: Any) -> bool:
    """True when labels may be read off predict_proba's output for this estimator."""
    return (
        type(estimator).__name__ in _PREDICT_IS_ARGMAX
        and type(estimator).__module__.startswith("sklearn.")
        and getattr(estimator, "n_outputs_", 1) == 1
        and hasattr(estimator, "classes_")
    )


class SklearnBackend:
    """A fitted estimator; each declared output is one method called on the input rows."""

    inline_safe = True  # native code: tiny batches may run on the event loop
    finite_inputs = True  # estimators refuse NaN and Inf: the server answers 400 before queueing
    __slots__ = ("_datatypes", "_estimator", "_from_proba", "_input", "_methods", "_model")

    def __init__(self, estimator: Any, config: ModelConfig) -> None:
        self._estimator = estimator
        self._model = config.name
        self._input = _input_name(config)
        self._methods = output_methods(config)  # output name -> method name
        self._datatypes = {spec.name: spec.datatype for spec in config.outputs}
        for output, method in self._methods.items():
            if not callable(getattr(estimator, method, None)):
                problem = (
                    f"output '{output}' needs {method}(), which {type(estimator).__name__} lacks"
                )
                raise ConfigError(config.source, "outputs", problem)
        methods = set(self._methods.values())
        self._from_proba = {"predict", "predict_proba"} <= methods and predict_from_proba(estimator)

    def infer(self, inputs: Arrays) -> Arrays:
        rows = self._rows(inputs)  # [batch, features]
        results: dict[str, np.ndarray] = {}  # method -> its result, each method called once
        if self._from_proba:
            proba = self._call("predict_proba", rows)  # [batch, classes]
            results["predict_proba"] = proba
            results["predict"] = np.asarray(self._estimator.classes_).take(proba.argmax(axis=1))
        outputs: Arrays = {}
        for output, method in self._methods.items():
            if method not in results:
                results[method] = self._call(method, rows)
            outputs[output] = _cast(results[method], self._datatypes.get(output))
        return outputs

    def _call(self, method: str, rows: np.ndarray) -> np.ndarray:
        try:
            return np.asarray(getattr(self._estimator, method)(rows))
        except Exception as exc:
            raise BackendError(f"model '{self._model}': {method}: {exc}") from exc

    def _rows(self, inputs: Arrays) -> np.ndarray:
        if self._input is not None:
            if self._input not in inputs:
                raise BadRequest(f"model '{self._model}': missing input '{self._input}'")
            rows = inputs[self._input]
        elif len(inputs) == 1:
            (rows,) = inputs.values()
        else:
            raise BadRequest(f"model '{self._model}' takes one input, got {len(inputs)}")
        if rows.ndim != 2:
            raise BadRequest(
                f"model '{self._model}': input must be 2-D [batch, features], "
                f"got shape {rows.shape}"
            )
        return rows

    def close(self) -> None:
        self._estimator = None


_UNPICKLING = threading.Lock()


def load(config: ModelConfig, version_dir: Path) -> SklearnBackend:
    """Load the estimator with joblib from the version folder (trusted repositories only)."""
    return SklearnBackend(_estimator(model_file(config, version_dir)), config)


def _estimator(path: Path) -> Any:
    try:
        with _UNPICKLING:  # unpickling imports sklearn: threads at once see half-imported modules
            return joblib.load(path)
    except Exception as exc:
        raise ConfigError(str(path), "model", f"joblib cannot load the estimator: {exc}") from exc


def autocomplete(config: ModelConfig, version_dir: Path) -> ModelConfig:
    """A config with no inputs and no outputs, completed from the estimator: its input of
    `n_features_in_` values and its `predict` output. Left as it is when it declares either,
    or when the estimator does not say how many features it takes."""
    if config.inputs or config.outputs:
        return config
    estimator = _estimator(model_file(config, version_dir))
    features = getattr(estimator, "n_features_in_", None)
    if not isinstance(features, int | np.integer):
        return config
    batch = () if config.batching else (-1,)  # without batching the batch dim is the model's
    inputs = (TensorSpec("input", "FP64", (*batch, int(features))),)
    outputs = (_predict_spec(estimator, int(features), batch),)
    return replace(config, inputs=inputs, outputs=outputs)


def _predict_spec(estimator: Any, features: int, batch: tuple[int, ...]) -> TensorSpec:
    """The output of `predict`, its datatype and values per row as one row of zeros gives
    them: a classifier's `label`, any other estimator's `predict`."""
    from sklearn.base import is_classifier

    name = "label" if is_classifier(estimator) else "predict"
    try:
        probe = np.asarray(estimator.predict(np.zeros((1, features))))  # [1, ...]
        datatype = datatype_of(probe)
    except Exception:  # an estimator that refuses zeros: one FP64 value per row
        return TensorSpec(name, "FP64", batch)
    return TensorSpec(name, datatype, (*batch, *probe.shape[1:]))


def output_methods(config: ModelConfig) -> dict[str, str]:
    """Output name -> estimator method, from the output names or `parameters.method`."""
    method = config.parameters.get("method")
    if not config.outputs:
        chosen = method or "predict"
        return {_DEFAULT_OUTPUT.get(chosen, chosen): chosen}
    methods: dict[str, str] = {}
    for index, spec in enumerate(config.outputs):
        known = _METHOD_BY_NAME.get(spec.name)
        if known is None and method is not None and len(config.outputs) == 1:
            known = method
        if known is None:
            problem = (
                f"cannot tell which method gives '{spec.name}': name it label or "
                "probabilities, or set parameters.method"
            )
            raise ConfigError(config.source, f"outputs[{index}].name", problem)
        methods[spec.name] = known
    return methods


def _input_name(config: ModelConfig) -> str | None:
    if len(config.inputs) > 1:
        names = ", ".join(spec.name for spec in config.inputs)
        raise ConfigError(
            config.source, "inputs", f"the sklearn backend takes one input, got {names}"
        )
    return config.inputs[0].name if config.inputs else None


def _cast(result: np.ndarray, datatype: str | None) -> np.ndarray:
    """The method's result in the declared datatype (BYTES: an object array of bytes)."""
    if datatype is None:
        return result
    if datatype == "BYTES":
        encoded = [str(item).encode() for item in result.ravel().tolist()]
        return np.array(encoded, dtype=object).reshape(result.shape)
    return result.astype(numpy_dtype(datatype), copy=False)

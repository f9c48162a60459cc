import argparse
import json

import pytest

from lockgate.plan import cli, profile_cli
from lockgate.plan.profile import ReplicaProfile
from lockgate.service_time import fit_service_time


def _args(module, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser.parse_args(argv)


def test_plan_report_and_json(capsys, tmp_path) -> None:
    argv = [
        "--rate",
        "5000",
        "--slo-ms",
        "50",
        "--service-ms",
        "5",
        "--capacity",
        "1143",
        "--cost-per-hour",
        "2",
    ]
    assert cli.run(_args(cli, argv)) == 0
    text = capsys.readouterr().out
    assert "RECOMMENDED: 12 replicas (slo-bound)" in text
    assert "after one failure" in text and "cost per million" in text and "window" in text
    assert cli.run(_args(cli, [*argv, "--json"])) == 0
    assert json.loads(capsys.readouterr().out)["replicas"] == 12
    path = tmp_path / "p.json"
    fit_service_time("m", (1, 2, 4), (0.005, 0.006, 0.008)).save(path)
    assert cli.run(_args(cli, ["--rate", "500", "--slo-ms", "50", "--profile", str(path)])) == 0


def test_plan_errors_exit_2(capsys) -> None:
    assert cli.run(_args(cli, ["--rate", "10", "--slo-ms", "1", "--service-ms", "5"])) == 2
    assert "cannot be met" in capsys.readouterr().err


def test_profile_cli_renders(capsys) -> None:
    args = _args(
        profile_cli, ["--model", "toy", "--max-batch-size", "4", "--url", "http://127.0.0.1:9"]
    )
    assert profile_cli.run(args) == 2
    assert "cannot reach" in capsys.readouterr().err
    text = profile_cli.render(ReplicaProfile(fit_service_time("m", (1, 2), (0.002, 0.003))))
    assert "T(B) = 1.000 ms + 1.0000 ms * B" in text and "server CPU" not in text
    measured = ReplicaProfile(fit_service_time("m", (1,), (0.002,)), 0.25, 0.0025, 0.0021)
    text = profile_cli.render(measured)
    assert "cv 0.25" in text and "front end on the model's core 0.400 ms" in text


def test_plan_reads_the_replica_fields_of_a_profile(capsys, tmp_path) -> None:
    """The front end's CPU moves from the fixed overhead into the service time."""
    service = fit_service_time("m", (1,), (0.010,), overhead_s=0.003)
    path = tmp_path / "p.json"
    ReplicaProfile(service, 0.3, 0.012, 0.010).save(path)
    argv = ["--rate", "50", "--slo-ms", "500", "--profile", str(path), "--json"]
    assert cli.run(_args(cli, [*argv, "--queue-model", "mg1"])) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["service_time_s"] == pytest.approx(0.012)
    assert result["overhead_s"] == pytest.approx(0.001)
    assert result["service_cv"] == pytest.approx(0.3)
    assert cli.run(_args(cli, [*argv, "--frontend-ms", "0", "--service-cv", "0"])) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["service_time_s"] == pytest.approx(0.010) and result["service_cv"] == 0
    (tmp_path / "bad.json").write_text(json.dumps({**service.to_json(), "service_cv": -1}))
    assert cli.run(_args(cli, [*argv[:4], "--profile", str(tmp_path / "bad.json")])) == 2
    assert "'service_cv' must be a finite number >= 0" in capsys.readouterr().err

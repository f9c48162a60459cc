import argparse
import json

from lockgate.plan import cli, profile_cli
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
    text = profile_cli.render(fit_service_time("m", (1, 2), (0.002, 0.003)))
    assert "T(B) = 1.000 ms + 1.0000 ms * B" in text

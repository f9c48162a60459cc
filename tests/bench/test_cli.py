import argparse
import importlib.util
import json

from lockgate.bench import cli
from tests.bench.fake_server import Behaviour, serve

HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None  # the optional plot extra


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(argv)


def test_sweep_writes_json_csv_and_plot(tmp_path, capsys) -> None:
    out = tmp_path / "r.json"
    with serve(Behaviour(sleep=lambda n: 0.003)) as (url, _):
        argv = [
            "--url",
            url,
            "--model",
            "toy",
            "--rate",
            "20,40",
            "--duration",
            "0.5",
            "--slo-ms",
            "50",
            "--quiet",
            "--output-json",
            str(out),
            "--output-csv",
            str(tmp_path / "r.csv"),
            "--output-requests-csv",
            str(tmp_path / "req.csv"),
        ]
        if HAVE_MATPLOTLIB:
            argv += ["--plot", str(tmp_path / "p.png")]
        assert cli.run(_args(argv)) == 0
    data = json.loads(out.read_text())
    assert [lv["offered_rate"] for lv in data["levels"]] == [20.0, 40.0]
    assert data["levels"][0]["latency_ms"]["p50"] >= 3.0
    assert len((tmp_path / "r.csv").read_text().splitlines()) == 3
    assert len((tmp_path / "req.csv").read_text().splitlines()) > 20
    if HAVE_MATPLOTLIB:
        assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "rate 20/s" in capsys.readouterr().out


def test_bad_arguments_exit_2(capsys) -> None:
    assert (
        cli.run(_args(["--model", "toy", "--rate", "10", "--concurrency", "2", "--duration", "1"]))
        == 2
    )
    assert "exactly one of --rate and --concurrency" in capsys.readouterr().err
    assert cli.run(_args(["--model", "toy", "--rate", "ten", "--duration", "1"])) == 2


def test_no_keep_alive_flag_reaches_the_config() -> None:
    base = ["--url", "http://127.0.0.1:1", "--model", "toy", "--concurrency", "1"]
    base += ["--num-requests", "1"]
    assert cli.config_from_args(_args(base)).keep_alive
    assert not cli.config_from_args(_args([*base, "--no-keep-alive"])).keep_alive


def test_runs_that_measure_nothing_are_refused(capsys) -> None:
    base = ["--url", "http://127.0.0.1:1", "--model", "toy", "--concurrency", "1"]
    for flags, message in (
        (["--duration", "0"], "--duration must be > 0"),
        (["--num-requests", "0"], "--num-requests must be at least 1"),
        (["--num-requests", "2", "--batch-size", "0"], "--batch-size must be at least 1"),
        (["--duration", "1", "--concurrency", "1,,2"], "--concurrency: an empty value"),
    ):
        assert cli.run(_args([*base, *flags])) == 2, flags
        assert message in capsys.readouterr().err


def test_a_run_where_every_request_failed_exits_1(capsys) -> None:
    """A CI gate on `lockgate bench` notices: every request refused is not a measurement."""
    with serve(Behaviour(fail=lambda n: 503)) as (url, _):
        argv = ["--url", url, "--model", "toy", "--concurrency", "2", "--num-requests", "10"]
        assert cli.run(_args([*argv, "--quiet"])) == 1
    assert "no request succeeded" in capsys.readouterr().err

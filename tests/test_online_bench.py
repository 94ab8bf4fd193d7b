"""serve-bench --online (minillm.lab.online): the arrival generator, the per-request formulas, and a tiny
online run's bookkeeping (every request answered in full, in every mode). Speed is never asserted."""

import json

import numpy as np
import pytest
import torch
from helpers import TINY, write_tiny_gguf

from minillm import load_model
from minillm.lab import online
from minillm.lab.online import RequestTiming, arrival_times, request_metrics, summarize, sustained_rate


def test_arrivals_are_seeded_with_mean_gap_one_over_rate():
    a = arrival_times(20_000, rate=4.0, burstiness=1.0, seed=1)
    assert a[0] == 0 and np.all(np.diff(a) >= 0)
    assert np.array_equal(a, arrival_times(20_000, 4.0, 1.0, seed=1))
    assert not np.array_equal(a, arrival_times(20_000, 4.0, 1.0, seed=2))
    gaps = np.diff(a)
    assert gaps.mean() == pytest.approx(1 / 4, rel=0.03)
    assert gaps.var() == pytest.approx(1 / 16, rel=0.06)  # Poisson: exponential gaps, variance 1 / rate^2


@pytest.mark.parametrize("burstiness", [0.25, 0.5, 2.0, 8.0])
def test_burstiness_changes_the_variance_not_the_mean(burstiness):
    gaps = np.diff(arrival_times(20_000, rate=2.0, burstiness=burstiness, seed=0))
    assert gaps.mean() == pytest.approx(1 / 2, rel=0.05)
    assert gaps.var() == pytest.approx(1 / (4 * burstiness), rel=0.1)  # gamma: 1 / (rate^2 * burstiness)


def test_arrivals_refuse_bad_rates():
    assert np.array_equal(arrival_times(3, float("inf")), np.zeros(3))
    for rate, b in ((0, 1), (-1, 1), (1, 0)):
        with pytest.raises(ValueError, match="rate"):
            arrival_times(5, rate, b)


def test_request_metrics_follow_vllms_definitions():
    t = RequestTiming(arrival=1.0, token_times=[1.5, 1.7, 2.0, 2.5], finish=2.5, output_tokens=4)
    m = request_metrics(t)
    assert m["ttft"] == pytest.approx(0.5) and m["e2el"] == pytest.approx(1.5)
    assert m["tpot"] == pytest.approx((1.5 - 0.5) / 3)  # (latency - TTFT) / (output tokens - 1)
    assert m["itl"] == pytest.approx([0.2, 0.3, 0.5])
    assert m["normalized_latency"] == pytest.approx(1.5 / 4)
    assert request_metrics(RequestTiming(0.0, [0.3], 0.3, 1))["tpot"] is None
    s = summarize([t, RequestTiming(0.0, [0.3], 0.3, 1)], [4, 2], ttft_slo=0.4, tpot_slo=1.0)
    assert s["answered_in_full"] == 1 and s["duration_s"] == pytest.approx(2.5)
    assert s["goodput"] == pytest.approx(1 / 2.5)  # only the second meets TTFT <= 0.4
    assert s["normalized_latency_s"] == pytest.approx((1.5 / 4 + 0.3) / 2)


def test_sustained_rate_interpolates_where_the_curve_crosses():
    assert sustained_rate([1, 2, 4], [0.1, 0.2, 0.6], 0.4) == (pytest.approx(3.0), False)
    assert sustained_rate([1, 2, 4], [0.1, 0.2, 0.3], 0.4) == (4.0, True)  # never crossed: a lower bound
    assert sustained_rate([1, 2], [0.5, 0.6], 0.4) == (0.0, False)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("online") / "tiny.gguf"
    write_tiny_gguf(path, cfg=dict(TINY, ctx=512))
    return path


@pytest.fixture(scope="module")
def tiny(tiny_path):
    return load_model(tiny_path)


def test_a_tiny_online_run_answers_every_request_in_full_in_every_mode(tiny, tmp_path):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        report = online.online_bench(*tiny, [20.0, 60.0], duration=0.25, http=True, scale=1 / 32, max_num_seqs=8,
                                     num_blocks=64, progress=False)
    finally:
        torch.set_num_threads(before)
    assert set(report["modes"]) == {"engine", "static", "http"}
    pool = online.make_requests(tiny[1], 15, scale=1 / 32)  # the largest rate's requests; lower rates take the first
    for mode, rows in report["modes"].items():
        assert [r["rate"] for r in rows] == [20.0, 60.0]
        for r, n in zip(rows, (5, 15)):
            assert r["num_requests"] == n and r["answered_in_full"] == n, (mode, r)
            assert r["output_tokens"] == sum(req.max_tokens for req in pool[:n])
            assert r["ttft_p50_s"] > 0 and r["normalized_latency_s"] > 0
    assert report["knee"]["threshold_s"] == pytest.approx(2 * report["modes"]["static"][0]["normalized_latency_s"])
    assert set(report["goals"]) == {"engine_vs_static_rate", "http_vs_in_process"}
    json.dumps(report)  # a record: plain data only
    assert online.plot_latency(report, tmp_path / "online.png").stat().st_size > 0
    assert "knee" in online.format_report(report)


def test_the_command_runs_online_and_refuses_bad_options_before_loading(tiny_path, tmp_path, capsys):
    from minillm.cli import main

    for argv, message in ((["--rate", "fast"], "rate"), (["--rate", "0"], "rate"), (["--duration", "0"], "duration"),
                          (["--requests", "8"], "requests")):
        assert main(["serve-bench", "--online", "--model", "/nonexistent.gguf", *argv]) == 2
        assert message in capsys.readouterr().err
    assert main(["serve-bench", "--online", "--model", str(tiny_path), "--rate", "30", "--duration", "0.2", "--quick",
                 "--threads", "1", "--max-num-seqs", "4", "--out", str(tmp_path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["scale"] == 1 / 32 and set(report["modes"]) == {"engine", "static"}
    assert report["modes"]["engine"][0]["answered_in_full"] == report["modes"]["engine"][0]["num_requests"] == 6
    assert (tmp_path / "online_latency.png").is_file() and json.loads((tmp_path / "online.json").read_text())["report"]

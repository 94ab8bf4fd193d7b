"""serve-bench's --background-load: its refusals, the processes it starts, and that none is left when the
block or the command ends (normally, on an error, past their time limit, or when their parent dies); the
Alpaca-like trace's own default scale."""

import argparse
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import write_tiny_gguf

from minillm.cli import main
from minillm.lab import background
from minillm.lab.background import background_load, check_load
from minillm.lab.serve_bench_cli import register, serve_bench_kwargs


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def _wait_gone(pids, seconds=10.0) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("n, limit, field", [(-1, 10, "--background-load"), (65, 10, "--background-load"),
                                             (1.5, 10, "--background-load"), (True, 10, "--background-load"),
                                             (1, 0, "limit_s")])
def test_check_load_refuses(n, limit, field):
    with pytest.raises(ValueError, match=field):
        check_load(n, limit)


def test_processes_run_in_the_block_and_are_gone_after_it():
    with background_load(2) as pids:
        assert len(pids) == 2 and all(_alive(p) for p in pids)
    assert not any(_alive(p) for p in pids)
    with background_load(0) as none:
        assert none == []


def test_processes_are_stopped_on_an_error():
    with pytest.raises(KeyError):
        with background_load(1) as pids:
            raise KeyError("a failing benchmark")
    assert not any(_alive(p) for p in pids)


def test_processes_end_by_themselves_past_their_limit():
    with background_load(1, limit_s=0.2) as pids:
        assert _wait_gone(pids)


def test_processes_end_when_their_parent_is_killed():
    parent = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\nfrom minillm.lab.background import background_load\n"
        "with background_load(1) as pids:\n    print(pids[0], flush=True)\n    time.sleep(60)\n")],
        stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    assert _alive(child)
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    assert _wait_gone([child])


def _args(*argv):
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(["serve-bench", *argv])


@pytest.mark.parametrize("argv,scale", [(["--trace", "alpaca"], 1.0), (["--trace", "sharegpt"], 0.25),
                                        (["--trace", "alpaca", "--scale", "0.5"], 0.5),
                                        (["--trace", "alpaca", "--quick"], 1 / 32)])
def test_alpaca_runs_at_its_own_lengths_unless_told(argv, scale):
    kwargs, lengths = serve_bench_kwargs(_args(*argv))
    assert kwargs["scale"] == scale and kwargs["trace"] == argv[1]
    if argv == ["--trace", "alpaca"]:
        assert 10 <= sum(p for p, _ in lengths) / len(lengths) <= 30  # the short requests of issue's trace


@pytest.mark.parametrize("value,message", [("-1", "argument --background-load: must be >= 0, got -1"),
                                           ("65", "error: --background-load: the number of CPU-bound processes "
                                                  "must be an integer in 0..64, got 65")])
def test_the_command_refuses_a_bad_load_before_loading(capsys, value, message):
    try:
        code = main(["serve-bench", "--threads", "1", "--background-load", value])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    assert code == 2 and message in err and out == "", err


def test_the_command_runs_beside_the_load_and_stops_it(capsys, tmp_path, monkeypatch):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    started = []
    real = background.background_load

    def spy(n, limit_s=background.LIMIT_S):
        cm = real(n, limit_s)
        pids = cm.__enter__()
        started.extend(pids)
        assert all(_alive(p) for p in pids)

        class Wrapper:
            def __enter__(self):
                return pids

            def __exit__(self, *exc):
                return cm.__exit__(*exc)
        return Wrapper()

    monkeypatch.setattr("minillm.lab.serve_bench_cli.background_load", spy)
    assert main(["serve-bench", "--model", str(path), "--quick", "--requests", "2", "--scale", "0.0625", "--json",
                 "--threads", "1", "--background-load", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["background_load"] == 2 and len(started) == 2
    assert not any(_alive(p) for p in started)


@pytest.mark.parametrize("argv, hint", [([], "add --peer"), (["--peer", "--spec", "ngram"], "--spec-repeats"),
                                        (["--peer", "--online"], "not --online")])
def test_peer_repeats_is_for_the_offline_run_with_the_peer(argv, hint):
    args = _args("--peer-repeats", "3", "--model", "/nonexistent", *argv)
    with pytest.raises(ValueError, match=f"--peer-repeats: 3 turns .*{hint}"):
        args.func(args)


def test_peer_turns_report_medians(tmp_path, monkeypatch):
    """--peer --peer-repeats 3: the engine and transformers run three turns; each mode keeps its run of median
    tokens/s, and the goal is the median of the turns' ratios (the machine is faked: the engine runs at 30, 20, 40
    and the peer at 5, 10, 20 tokens/s: the ratios 6, 2, 2 have the median 2, the medians' ratio would be 3)."""
    from minillm import load_model
    from minillm.lab import serve_bench as lab

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    model, tok = load_model(path)
    engine_speeds, peer_speeds = iter([30.0, 20.0, 40.0]), iter([5.0, 10.0, 20.0])
    real_engine, engines = lab.run_engine, []

    def fake_engine(*a, **k):
        run = real_engine(*a, **k)
        if k.get("speculative_config"):
            return run
        engines.append(run["engine"])
        return dict(run, output_tokens_per_s=next(engine_speeds))

    monkeypatch.setattr(lab, "run_engine", fake_engine)
    monkeypatch.setattr(lab, "load_transformers_peer", lambda **k: "peer")
    monkeypatch.setattr(lab, "run_transformers", lambda hf, reqs, n, kv_tokens: dict(
        lab.run_sequential(model, reqs), output_tokens_per_s=next(peer_speeds)))
    report = lab.serve_bench(model, tok, num_requests=2, scale=1 / 16, peer=True, peer_repeats=3, progress=False,
                             memory_requests=0, sharing_requests=0)
    assert report["turns"] == [{"engine": 30.0, "transformers": 5.0}, {"engine": 20.0, "transformers": 10.0},
                               {"engine": 40.0, "transformers": 20.0}]
    assert report["modes"]["engine"]["output_tokens_per_s"] == 30.0
    assert report["modes"]["engine"]["output_tokens_per_s_runs"] == [30.0, 20.0, 40.0]
    assert report["modes"]["transformers"]["output_tokens_per_s"] == 10.0
    assert report["goals"]["engine_vs_transformers"]["measured"] == 2.0
    assert "3 turns of engine / transformers" in lab.format_report(report)
    assert len(engines) == 3 and report["_engine"] is engines[0]  # the notebook's timeline: the first run's engine
    engine_speeds, peer_speeds = iter([30.0]), iter([5.0])
    once = lab.serve_bench(model, tok, num_requests=2, scale=1 / 16, peer=True, progress=False, memory_requests=0,
                           sharing_requests=0)
    assert "turns" not in once and "output_tokens_per_s_runs" not in once["modes"]["engine"]
    assert once["goals"]["engine_vs_transformers"]["measured"] == 6.0 and list(once["modes"])[-1] == "transformers"


def test_bench_decode_runs_beside_the_load_and_stops_it(capsys, tmp_path, monkeypatch):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    started = []
    real = background.background_load

    class Spy:
        def __init__(self, n, limit_s=background.LIMIT_S):
            self.cm = real(n, limit_s)

        def __enter__(self):
            pids = self.cm.__enter__()
            started.extend(pids)
            assert all(_alive(p) for p in pids)
            return pids

        def __exit__(self, *exc):
            return self.cm.__exit__(*exc)

    monkeypatch.setattr("minillm.cli.background_load", Spy)
    assert main(["bench", "decode", "--model", str(path), "--no-peer", "--new-tokens", "2", "--repeats", "1",
                 "--json", "--background-load", "1"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["background_load"] == 1 and len(started) == 1
    assert not any(_alive(p) for p in started)
    try:
        code = main(["bench", "decode", "--background-load", "65"])
    except SystemExit as e:
        code = e.code
    assert code == 2 and "--background-load" in capsys.readouterr().err

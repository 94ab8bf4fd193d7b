"""The fragmentation lab: the share of reserved KV memory holding tokens, by hand and on the traces,
its JSON and its command (minillm.paged.fragmentation, minillm.lab.fragmentation)."""

import argparse
import json

import pytest

from minillm.lab.fragmentation import BLOCK_SIZES, fork_example, register, run_lab
from minillm.paged import TRACES, kv_utilization, make_trace


def test_utilization_by_hand():
    # one request, prompt 3, output 2: it holds 3 then 4 written positions over its two iterations
    assert kv_utilization([3], [2], "paged_4") == 7 / 8
    assert kv_utilization([3], [2], "paged_1") == 1.0
    assert kv_utilization([3], [2], "oracle") == 7 / 10
    assert kv_utilization([3], [2], "pow2") == 7 / 16
    assert kv_utilization([3], [2], "max", max_seq_len=16) == 7 / 32
    # two requests: each iteration counts once, so a longer life weighs more
    assert kv_utilization([1, 4], [1, 3], "paged_4") == (1 + 4 + 5 + 6) / (4 + 4 + 8 + 8)
    with pytest.raises(ValueError, match="not max, pow2, oracle or paged_<block size>"):
        kv_utilization([3], [2], "paged_x")
    with pytest.raises(ValueError, match="at least one request"):
        kv_utilization([], [], "max")


def test_traces_are_seeded_and_within_the_context():
    for name, spec in TRACES.items():
        prompt, output = make_trace(spec)
        again = make_trace(spec)
        assert (prompt == again[0]).all() and (output == again[1]).all()
        assert prompt.min() >= 1 and output.min() >= 1 and (prompt + output).max() <= 2048
        assert abs(prompt.mean() / spec.mean_prompt - 1) < 0.05 and abs(output.mean() / spec.mean_output - 1) < 0.05


def test_lab_report_shape_and_the_papers_ordering():
    report = run_lab()
    for name in ("sharegpt", "alpaca"):
        schemes = report["traces"][name]["schemes"]
        assert set(schemes) == {"max", "pow2", "oracle"} | {f"paged_{bs}" for bs in BLOCK_SIZES}
        assert all(0 < x <= 1 for x in schemes.values())
        paged = [schemes[f"paged_{bs}"] for bs in BLOCK_SIZES]
        assert paged == sorted(paged, reverse=True) and paged[0] == 1.0  # bigger blocks waste more
        assert schemes["max"] < schemes["pow2"] < schemes["oracle"] < schemes["paged_16"]
    assert report["traces"]["sharegpt"]["schemes"]["paged_16"] > 0.96  # the goal: under 4% waste
    with pytest.raises(ValueError, match="trace: 'lmsys' is not one of"):
        run_lab(["lmsys"])


def test_fragmentation_command_json_and_figures(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["fragmentation", "--trace", "alpaca", "--json", "--out", str(tmp_path)])
    assert args.func(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert list(report["traces"]) == ["alpaca"] and 0 < report["traces"]["alpaca"]["schemes"]["paged_16"] < 1
    assert (tmp_path / "paged_memory_vs_block_size.png").stat().st_size > 0
    assert (tmp_path / "paged_fork_cow.png").stat().st_size > 0
    args = parser.parse_args(["fragmentation", "--trace", "sharegpt", "--out", str(tmp_path)])
    assert args.func(args) == 0
    table = capsys.readouterr().out
    assert "paged_16" in table and "sharegpt" in table and "96.3%" in table


def test_fork_example_shares_full_blocks_and_copies_the_last():
    m, copies = fork_example(block_size=4, prompt_len=10)
    t0, t1 = m.block_table(0), m.block_table(1)
    assert t0[:2] == t1[:2] and all(m.ref_counts[b] == 2 for b in t0[:2])
    assert copies == [(t0[2], t1[2])] and m.ref_counts[t0[2]] == m.ref_counts[t1[2]] == 1

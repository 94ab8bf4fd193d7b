"""The simulation's arithmetic on hand-computed cases (one step's time, the all-reduce term, the KV pool's
blocks, the CPU's calibration), the real scheduler under the clock, routing, and serve-bench --simulate."""

import json
import math

import pytest

from minillm.lab.hardware import DEVICES, Device, cpu_device, device_named, model_named
from minillm.lab.sim_router import route, shared_prefix_requests, simulate_router
from minillm.lab.simulate import SimEngine, all_reduce_time, kv_pool_blocks, max_concurrency, simulate, step_cost
from minillm.config import ModelConfig

# per layer: C*D*(H + 2 Hkv) + H*D*C + 3*C*F = 8*4*4 + 2*4*8 + 3*8*16 = 576; head: V*C = 256
TINY = ModelConfig(n_layers=2, dim=8, n_heads=2, n_kv_heads=1, head_dim=4, ffn_dim=16, vocab_size=32, max_seq_len=64)


def device(**kw) -> Device:
    fields = dict(name="toy", memory=1e6, bandwidth=1000.0, flops=1000.0, link_bandwidth=100.0, link_latency=0.01,
                  step_overhead=0.5)
    fields.update(kw)
    return Device(**fields)


def test_all_reduce_is_the_ring_formula():
    # 2 (p-1)/p x bytes / bandwidth + latency x log2 p = 2*7/8 * 1e6 / 1e9 + 1e-5 * 3
    assert all_reduce_time(1e6, 8, 1e9, 1e-5) == pytest.approx(1.75e-3 + 3e-5)
    assert all_reduce_time(1e6, 2, 1e9, 1e-5) == pytest.approx(1e-3 + 1e-5)
    assert all_reduce_time(1e6, 1, 1e9, 1e-5) == 0.0


def test_one_step_by_hand():
    # spans (context, new): a decode at 10 cached positions and a 4-token prefill; both sample
    # tokens 5; (query, key) pairs 1*10 + 1 + 4*5/2 = 21
    # FLOPs 2 layers * (2*5*576 + 4*21*2*4) + 2*2*256 = 13,888
    # bytes (bfloat16): weights (2*576 + 256) * 2 = 2,816; KV 2*2*1*4*2 = 32 per token * (11 + 4) = 480
    cost = step_cost(TINY, device(), [(10, 1), (0, 4)], sampled=2)
    assert cost["flops"] == 13888
    assert cost["bytes"] == 2816 + 480
    assert cost["compute_s"] == pytest.approx(13.888) and cost["memory_s"] == pytest.approx(3.296)
    assert cost["all_reduce_s"] == 0
    assert cost["time_s"] == pytest.approx(13.888 + 0.5)  # the larger bound, plus the overhead


def test_one_step_with_tensor_parallelism_by_hand():
    # tp 2: FLOPs and weights halve; the one KV head is copied on both devices (32 bytes a token still);
    # all-reduce of 5 tokens * 8 * 2 bytes = 80 bytes: 2*1/2 * 80 / 100 + 0.01 * 1 = 0.81 s, 2 per layer
    cost = step_cost(TINY, device(), [(10, 1), (0, 4)], sampled=2, tp=2)
    assert cost["compute_s"] == pytest.approx(6.944)
    assert cost["bytes"] == 1408 + 480
    assert cost["all_reduce_s"] == pytest.approx(4 * 0.81)
    assert cost["time_s"] == pytest.approx(6.944 + 0.5 + 3.24)


def test_pool_blocks_by_hand():
    # 0.9 * 1e6 usable; weights: n_params 1,448 (2 layers of 576 + 16 norms, tied 256 embedding, 8 final norm)
    # * 2 bytes = 2,896; a block: 16 tokens * 32 bytes = 512 -> (900,000 - 2,896) // 512 = 1,752
    assert TINY.n_params == 1448
    assert kv_pool_blocks(device(), TINY, block_size=16) == 1752
    # tp 2: weights 1,448 a device, KV per token still 32 bytes (the one KV head on both)
    assert kv_pool_blocks(device(), TINY, tp=2, block_size=16) == (900_000 - 1448) // 512


def test_pool_refuses_weights_that_do_not_fit():
    with pytest.raises(ValueError, match=r"--tp: .*use --tp 2 or more"):
        kv_pool_blocks(DEVICES["h100"], model_named("llama-3.1-70b"))
    assert kv_pool_blocks(DEVICES["h100"], model_named("llama-3.1-70b"), tp=2) > 0


def test_70b_on_8_h100s_pool_by_hand():
    # 70B bf16: n_params * 2 bytes / 8 devices; KV 2 * 80 layers * 1 head * 128 * 2 bytes = 40,960 B per token
    cfg = model_named("llama-3.1-70b")
    usable = 80e9 * 0.9 - cfg.n_params * 2 / 8
    assert kv_pool_blocks(DEVICES["h100"], cfg, tp=8) == int(usable // (40960 * 16))


def test_cpu_device_from_roofline_rows():
    # decode B=1: 50 ms measured, 5e8 bytes at 2e10 B/s = 25 ms -> 25 ms overhead;
    # prefill 3e10 FLOPs in 325 ms, less the overhead: 3e10 / 0.3 = 1e11 FLOP/s
    report = {"bandwidth": 2e10, "rows": [
        {"kind": "decode", "dtype": "float32", "batch_size": 1, "measured_s": 0.05, "bytes": 5e8, "tokens": 1},
        {"kind": "prefill", "dtype": "float32", "batch_size": 1, "measured_s": 0.325, "flops": 3e10, "tokens": 128}]}
    d = cpu_device(report)
    assert d.step_overhead == pytest.approx(0.025) and d.flops == pytest.approx(1e11) and d.memory is None
    assert d.flops_at(32) == pytest.approx(1e11)  # one point: the prefill's rate at every size
    # decode B=8: 2e9 FLOPs in 125 ms, less the 25 ms overhead -> 2e10 FLOP/s at 8 rows
    report["rows"].append({"kind": "decode", "dtype": "float32", "batch_size": 8, "measured_s": 0.125, "flops": 2e9,
                           "bytes": 5e8, "tokens": 8})
    d = cpu_device(report)
    assert [x for point in d.flops_by_rows for x in point] == pytest.approx([8, 2e10, 128, 1e11])
    # linear in log2(rows): 32 rows is half way from 8 to 128; held at the ends
    assert d.flops_at(32) == pytest.approx(6e10)
    assert d.flops_at(2) == pytest.approx(2e10) and d.flops_at(1000) == pytest.approx(1e11)
    with pytest.raises(ValueError, match="roofline"):
        cpu_device({"bandwidth": 1, "rows": []})


def test_device_and_model_names():
    assert device_named("H100 SXM") is DEVICES["h100"] and device_named("A100 80GB") is DEVICES["a100"]
    with pytest.raises(ValueError, match="--simulate: 'tpu'"):
        device_named("tpu")
    with pytest.raises(ValueError, match="--sim-model"):
        model_named("gpt-5")
    assert model_named("llama-3.1-8b").n_params == pytest.approx(8.03e9, rel=0.01)  # Meta: 8.03B
    assert model_named("llama-3.1-70b").n_params == pytest.approx(70.6e9, rel=0.01)  # Meta: 70.6B
    for d in DEVICES.values():
        assert {"memory", "bandwidth", "flops", "link_bandwidth", "step_overhead"} <= set(d.sources)


def overhead_only(**kw) -> Device:
    """A device whose step costs only its 1 s overhead: every time below is a count of steps."""
    return device(bandwidth=1e30, flops=1e30, step_overhead=1.0, **kw)


def test_clock_counts_the_real_schedulers_steps():
    # one request: 4 prompt tokens in one step (its first token), then 2 decode steps
    out = simulate(TINY, overhead_only(), [(list(range(4)), 3)])
    assert (out["steps"], out["wall_s"], out["ttft_p50_s"], out["tpot_p50_s"]) == (3, 3.0, 1.0, 1.0)
    # a 10-token prompt with a budget of 4 tokens a step: chunks 4, 4, 2 -> its first token after 3 steps
    out = simulate(TINY, overhead_only(), [(list(range(10)), 2)], max_num_batched_tokens=4)
    assert (out["steps"], out["ttft_p50_s"]) == (4, 3.0)


def test_requests_share_steps_and_a_late_arrival_waits():
    # two requests at t=0 decode together: 1 prefill step + 4 decode steps for both
    out = simulate(TINY, overhead_only(), [(list(range(4)), 5), (list(range(10, 14)), 5)])
    assert out["steps"] == 5 and out["output_tokens_per_s"] == pytest.approx(10 / 5)
    # the second arrives at t=10, after the first finished (t=5): the engine idles, then 5 more steps
    out = simulate(TINY, overhead_only(), [(list(range(4)), 5), (list(range(10, 14)), 5)], arrivals=[0, 10])
    assert out["wall_s"] == 15.0 and out["ttft_p99_s"] == pytest.approx(1.0, rel=0.02)


def test_prefix_cache_hits_by_hand():
    # the second prompt starts with the first's two full blocks (32 tokens) and arrives after it ran
    first, second = list(range(40)), list(range(32)) + list(range(100, 108))
    out = simulate(TINY, overhead_only(), [(first, 2), (second, 2)], arrivals=[0, 10])
    assert out["prefix_hit_rate"] == pytest.approx(32 / 80)
    off = simulate(TINY, overhead_only(), [(first, 2), (second, 2)], arrivals=[0, 10], enable_prefix_caching=False)
    assert off["prefix_hit_rate"] == 0


def test_small_pool_preempts_and_still_finishes():
    reqs = [(list(range(i * 50, i * 50 + 20)), 20) for i in range(4)]  # 40 tokens each: 3 blocks of 16
    out = simulate(TINY, overhead_only(), reqs, num_blocks=6)
    assert out["preemptions"] > 0 and out["peak_blocks"] <= 6 and out["output_tokens"] == 80


def test_request_larger_than_the_pool_is_refused():
    engine = SimEngine(TINY, overhead_only(), num_blocks=2)
    with pytest.raises(ValueError, match="blocks and the simulated pool holds 2"):
        engine.add_request("0", list(range(30)), 10, 0.0)


def test_max_concurrency_by_hand():
    # decode steps cost 0.5 s of overhead plus FLOPs: b sequences at context 10 on the toy device
    d = device()
    target = step_cost(TINY, d, [(10, 1)] * 3, 3)["time_s"]
    got = max_concurrency(TINY, d, 10, target, num_blocks=1000)
    assert got["concurrency"] == 3 and got["limit"] == "tpot"
    got = max_concurrency(TINY, d, 10, 1e9, num_blocks=5)  # 1 block a sequence at 11 tokens: the pool limits
    assert got["concurrency"] == 5 and got["limit"] == "kv pool"
    assert max_concurrency(TINY, d, 10, 0.1, num_blocks=5)["concurrency"] == 0


def test_route_round_robin_and_cache_aware():
    trees, loads = [set(), set()], [0, 0]
    assert [route("round_robin", [1] * 32, trees, loads, n) for n in range(4)] == [0, 1, 0, 1]
    a, b = list(range(64)), list(range(100, 164))
    first = route("cache_aware", a, trees, loads, 0)
    second = route("cache_aware", b, trees, loads, 1)  # no match: the smaller tree
    assert second != first
    assert route("cache_aware", a[:48] + [7] * 16, trees, loads, 2) == first  # 48 of 64 tokens matched
    assert route("cache_aware", a, trees, [40, 0] if first == 0 else [0, 40], 3) == 1 - first  # imbalance wins
    with pytest.raises(ValueError, match="policy"):
        route("random", a, trees, loads, 0)


def test_cache_aware_beats_round_robin_on_shared_prefixes():
    reqs = shared_prefix_requests(64, 4, 64, 8, 4, TINY.vocab_size, seed=1)
    arrivals = [0.5 * i for i in range(64)]
    rr = simulate_router(TINY, overhead_only(), reqs, arrivals, 4, "round_robin", num_blocks=200)
    ca = simulate_router(TINY, overhead_only(), reqs, arrivals, 4, "cache_aware", num_blocks=200)
    # each of 4 prefixes misses once per replica that sees it: round robin up to 16 misses, cache-aware 4
    assert ca["prefix_hit_rate"] > rr["prefix_hit_rate"]
    assert sum(rr["requests_per_replica"]) == sum(ca["requests_per_replica"]) == 64


def test_serve_bench_simulate_command(capsys):
    from minillm.cli import main
    assert main(["serve-bench", "--simulate", "h100", "--sim-model", "llama-3.1-8b", "--requests", "8", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    sim = report["sim"]
    assert sim["output_tokens"] == sum(1 for _ in range(8)) * report["mean_output"]
    assert sim["num_blocks"] == kv_pool_blocks(DEVICES["h100"], model_named("llama-3.1-8b"))
    assert math.isfinite(sim["tpot_p50_s"]) and sim["tpot_p50_s"] > 0


def test_serve_bench_simulate_refuses_bad_options(capsys):
    from minillm.cli import main
    assert main(["serve-bench", "--simulate", "tpu", "--requests", "2"]) != 0
    assert "--simulate: 'tpu'" in capsys.readouterr().err
    assert main(["serve-bench", "--simulate", "h100", "--sim-model", "llama-3.1-70b", "--requests", "2"]) != 0
    assert "use --tp 2 or more" in capsys.readouterr().err


def test_serve_bench_simulate_refuses_tp_on_the_cpu_before_measuring_it(capsys, monkeypatch):
    from minillm.cli import main
    from minillm.lab import simulate
    monkeypatch.setattr(simulate, "sim_device", lambda args: pytest.fail("measured the CPU before refusing --tp"))
    assert main(["serve-bench", "--simulate", "cpu", "--tp", "2", "--requests", "2"]) != 0
    assert "--tp: 2 devices, but cpu is this one machine" in capsys.readouterr().err
    assert main(["serve-bench", "--tp", "2", "--requests", "2"]) != 0  # without --simulate: refused, not ignored
    assert "--tp: prices a simulated run; add --simulate" in capsys.readouterr().err


def test_mean_of_two_calibrations():
    from minillm.lab.sim_fidelity import mean_device
    a = device(bandwidth=10.0, flops=100.0, step_overhead=0.5, sources={"bandwidth": "a", "flops": "a",
                                                                        "step_overhead": "a"})
    b = device(bandwidth=30.0, flops=300.0, step_overhead=1.5, sources={"bandwidth": "b", "flops": "b",
                                                                        "step_overhead": "b"})
    m = mean_device([a, b])
    assert (m.bandwidth, m.flops, m.step_overhead, m.memory) == (20.0, 200.0, 1.0, a.memory)
    assert "mean of 2 roofline runs" in m.sources["flops"]

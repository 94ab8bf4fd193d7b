"""Is the simulation right where it can be checked? On this CPU: roofline's ceilings measured first (they are
the simulation's only calibration), then serve-bench's engine run on each trace, then the simulation of the
same requests with the same settings; the table sets measured and simulated side by side.

Nothing is fitted to the runs compared: the CPU's bandwidth, matmul throughput and per-step overhead come from
``roofline``'s own rows (``hardware.cpu_device``), and the host time of scheduling is the simulation's own. On a
machine shared with other work the ceilings move from minute to minute, so roofline runs right before and right
after each measured run, and the simulation takes the mean of the two calibrations.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace

import numpy as np

from ..paged.engine import LLMEngine
from ..roofline.ceilings import compare, measure
from ..timing import busy_cores, machine
from .hardware import Device, cpu_device
from .online import arrival_times, run_engine as run_engine_online
from .serve_bench import _summary, drive_engine, make_requests
from .simulate import simulate

__all__ = ["FIDELITY_BOUND", "fidelity"]

FIDELITY_BOUND = 0.25  # simulated within 25% of measured, on throughput and median TPOT
DEFAULT_TRACES = (("sharegpt", 32, 0.25, None), ("alpaca", 32, 1.0, None), ("sharegpt", 16, 0.25, 1.0))


def roofline_report(model) -> dict:
    """What ``python -m minillm roofline --json`` reports (its default rows: decode B=1 and 8, prefill T=128)."""
    ceilings = measure("cpu", dtypes=("float32",))
    rows = compare(model, ceilings, (1, 8), (128,))
    return {"machine": machine(), "bandwidth": ceilings.bandwidth, "matmul_flops": ceilings.matmul_flops, "rows": rows}


def mean_device(devices: list[Device]) -> Device:
    """One device whose bandwidth, matmul throughput and overhead are the means of ``devices``' (calibrations
    of the same machine taken minutes apart); its sources say so."""
    first = devices[0]
    mean = {k: float(np.mean([getattr(d, k) for d in devices])) for k in ("bandwidth", "flops", "step_overhead")}
    mean["flops_by_rows"] = tuple((r, float(np.mean([d.flops_by_rows[i][1] for d in devices])))
                                  for i, (r, _) in enumerate(first.flops_by_rows))
    sources = dict(first.sources, **{k: f"the mean of {len(devices)} roofline runs around the measured run: " + "; ".join(
        d.sources[k] for d in devices) for k in ("bandwidth", "flops", "step_overhead")})
    return replace(first, **mean, sources=sources)


def measured_run(model, reqs, arrivals, engine_kwargs: dict) -> dict:
    """serve-bench's engine row (all at t=0: ``drive_engine``) or its online engine (``arrivals``)."""
    if arrivals is None:
        engine = LLMEngine(model, **engine_kwargs)
        _, wall, ttft, tpot = drive_engine(engine, reqs)
        return _summary(reqs, wall, ttft, tpot, [])
    timings, _ = run_engine_online(model, reqs, arrivals, engine_kwargs)
    out = sum(r.max_tokens for r in reqs)
    wall = max(t.finish for t in timings)
    tpot = [(t.token_times[-1] - t.token_times[0]) / (len(t.token_times) - 1) for t in timings
            if len(t.token_times) > 1]
    return {"wall_s": wall, "output_tokens_per_s": out / wall, "tpot_p50_s": float(np.median(tpot)),
            "ttft_p50_s": float(np.median([t.token_times[0] - t.arrival for t in timings]))}


def fidelity(model, tokenizer, traces=DEFAULT_TRACES, block_size: int = 16, max_num_seqs: int = 64,
             max_num_batched_tokens: int = 256) -> dict:
    """For each (trace, requests, scale, rate or None): roofline, the measured engine, roofline again, then the
    simulation on the two calibrations' mean; returns {"machine", "rows", "load"}, each row with both runs, their
    ratios, its calibration and roofline reports."""
    load_before = os.getloadavg()
    busy = busy_cores()
    kwargs = dict(block_size=block_size, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    rows = []
    for trace, n, scale, rate in traces:
        reqs = make_requests(tokenizer, n, trace, scale)
        arrivals = None if rate is None else arrival_times(n, rate)
        started = time.time()
        before = roofline_report(model)
        real = measured_run(model, reqs, arrivals, kwargs)
        after = roofline_report(model)
        device = mean_device([cpu_device(before), cpu_device(after)])
        sim = simulate(model.config, device, [(r.prompt_token_ids, r.max_tokens) for r in reqs], arrivals,
                       host_time=True, **kwargs)
        rows.append({"trace": trace, "requests": n, "scale": scale, "rate": rate, "measured": real, "simulated": sim,
                     "throughput_ratio": sim["output_tokens_per_s"] / real["output_tokens_per_s"],
                     "tpot_ratio": sim["tpot_p50_s"] / real["tpot_p50_s"], "seconds": time.time() - started,
                     "device": _device_record(device), "roofline": [before, after], "load_after": os.getloadavg()})
    for row in rows:
        row["within"] = all(abs(row[k] - 1) <= FIDELITY_BOUND for k in ("throughput_ratio", "tpot_ratio"))
    return {"machine": machine(), "rows": rows,
            "load": {"before": load_before, "after": os.getloadavg(), "busy_cores_before": busy}}


def _device_record(device: Device) -> dict:
    return {"name": device.name, "bandwidth": device.bandwidth, "flops": device.flops,
            "step_overhead": device.step_overhead, "flops_by_rows": device.flops_by_rows, "sources": device.sources}


def format_fidelity(report: dict) -> str:
    """The fidelity table, one row per trace."""
    load = report["load"]
    lines = [f"{report['machine']}; load average (1/5/15 min) {', '.join(f'{x:.2f}' for x in load['before'])} before, "
             f"{', '.join(f'{x:.2f}' for x in load['after'])} after",
             f"{'trace':<28}{'meas tok/s':>11}{'sim tok/s':>10}{'ratio':>7}{'meas TPOT':>10}{'sim TPOT':>9}{'ratio':>7}  ok"
             "  calibration (GB/s, GFLOP/s, ms/step)"]
    for r in report["rows"]:
        name = f"{r['trace']} x{r['scale']} {r['requests']} req" + (f" @{r['rate']}/s" if r["rate"] else "")
        m, s = r["measured"], r["simulated"]
        lines.append(f"{name:<28}{m['output_tokens_per_s']:>11.1f}{s['output_tokens_per_s']:>10.1f}"
                     f"{r['throughput_ratio']:>7.2f}{m['tpot_p50_s'] * 1e3:>10.1f}{s['tpot_p50_s'] * 1e3:>9.1f}"
                     f"{r['tpot_ratio']:>7.2f}  {'yes' if r['within'] else 'NO ':<3}  {r['device']['bandwidth'] / 1e9:.1f}, "
                     f"{r['device']['flops'] / 1e9:.1f}, {r['device']['step_overhead'] * 1e3:.1f}")
    return "\n".join(lines)


#: docs/gpu.md's H200 record (float32, roofline --device cuda): measured ceilings and (kind, B or T, tokens/s)
H200_RECORD = {"bandwidth": 3.95e12, "flops": 51e12, "context": 64,
               "rows": [("decode", 1, 72), ("decode", 8, 403), ("decode", 32, 1902), ("prefill", 128, 5632),
                        ("prefill", 512, 27113), ("prefill", 2048, 49227)]}


def h200_check(record: dict = H200_RECORD) -> list[dict]:
    """The step cost against docs/gpu.md's H200 forwards: its measured ceilings, and the overhead its batch-1
    decode took beyond them (calibrated on that row alone); each other row's predicted and measured seconds.
    Prefill computes every token's logits there (``roofline.compare``), decode reads ``context`` positions."""
    from ..config import ModelConfig
    from .hardware import Device
    from .simulate import step_cost
    config = ModelConfig()
    base = Device("H200 (measured, float32)", None, record["bandwidth"], record["flops"], 1e12, 0.0, 0.0, "float32")

    def spans(kind, n):
        return ([(record["context"], 1)] * n, n) if kind == "decode" else ([(0, n)], n)

    overhead = 1 / record["rows"][0][2] - step_cost(config, base, *spans("decode", 1))["time_s"]
    rows = []
    for kind, n, tokens_per_s in record["rows"]:
        cost = step_cost(config, base, *spans(kind, n), overhead=overhead)
        measured = n / tokens_per_s
        rows.append({"kind": kind, "n": n, "roofline_s": cost["time_s"] - overhead, "predicted_s": cost["time_s"],
                     "measured_s": measured, "predicted_over_measured": cost["time_s"] / measured,
                     "overhead_s": overhead})
    return rows


def main(argv=None) -> int:
    """``python -m minillm.lab.sim_fidelity [--out FILE]``: the fidelity table on this CPU (minutes), its record
    written as strict JSON to FILE."""
    import argparse

    from ..files import dumps_strict
    from ..loading import load_model
    p = argparse.ArgumentParser(description="the simulation against measured serve-bench runs on this CPU")
    p.add_argument("--out", default=None, help="write the record here (JSON)")
    args = p.parse_args(argv)
    model, tokenizer = load_model()
    report = fidelity(model, tokenizer)
    print(format_fidelity(report))
    if args.out:
        with open(args.out, "w") as f:
            f.write(dumps_strict(report) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

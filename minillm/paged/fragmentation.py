"""The fragmentation lab: how much of the reserved KV memory holds tokens, under reservation and paging.

Kwon et al. 2023 (vLLM, arXiv 2309.06180), Sec. 3 and Fig. 2: systems that reserve a contiguous
chunk per request keep only 20.4-38.2% of their KV memory holding token states; vLLM (paging, block
size 16) 96.3%. The schemes, for a request with a prompt of P tokens and O output tokens:

* "max" (Orca (Max)): ``max_seq_len`` slots reserved from the start;
* "pow2" (Orca (Pow2)): the next power of two at or above P + O, reserved from the start;
* "oracle" (Orca (Oracle)): exactly P + O, reserved from the start (so still the future output);
* "paged_<bs>": ``blocks_for(tokens held, bs) * bs`` slots, growing with the sequence; the waste
  is confined to the last block (under bs slots).

The measure. A request lives O decode iterations (continuous batching: one token per iteration, the
first being the prefill); by the end of iteration t it holds P + t - 1 written positions (the last new
token's keys and values are never written). The share of reserved memory holding tokens is the
time average over the requests in flight: at each iteration, the slots holding tokens over the slots
reserved, summed over every iteration of the run. As each request contributes each of its
iterations once, whatever the schedule, the ratio is sum_r sum_t held_r(t) / sum_r sum_t
reserved_r(t), schedule independent: the lab needs only the lengths.

What the lab leaves out: external fragmentation (a contiguous allocator's free memory in gaps too
small for the next request), which the paper's Fig. 2 counts for Orca (8.9 / 41.6 / 36.6% of memory
for Max / Pow2 / Oracle). Our reservation numbers are therefore higher than the paper's; the report's
"paper_without_external" takes it out of the paper's (token states / (1 - external)), which is what
the lab measures. Paging has no external fragmentation, so its numbers compare directly.

The traces: lengths drawn from log-normal distributions (sigma 1.0 in log space, mu set so that the
untruncated mean is the paper's), with a fixed seed, rounded to whole tokens, at least one token,
and each request cut to max_seq_len = 2,048 (output shortened). ShareGPT-like: mean prompt 161,
mean output 338; Alpaca-like: 19 and 58 (the paper's Sec. 6.1 statistics). The realised means are
in the report.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .block_manager import blocks_for

MAX_SEQ_LEN = 2048
BLOCK_SIZES = tuple(2 ** i for i in range(9))  # 1, 2, 4, ..., 256
PAPER = {"max": 0.204, "pow2": 0.268, "oracle": 0.382, "paged_16": 0.963}  # Fig. 2: token states
PAPER_EXTERNAL = {"max": 0.089, "pow2": 0.416, "oracle": 0.366}  # Fig. 2: external fragmentation


@dataclass(frozen=True)
class TraceSpec:
    """Length statistics of a request trace: means in tokens, log-normal sigma, requests, seed."""

    mean_prompt: float
    mean_output: float
    sigma: float = 1.0
    num_requests: int = 10000
    seed: int = 0


TRACES = {"sharegpt": TraceSpec(161, 338), "alpaca": TraceSpec(19, 58)}


def make_trace(spec: TraceSpec, max_seq_len: int = MAX_SEQ_LEN) -> tuple[np.ndarray, np.ndarray]:
    """(prompt_lens, output_lens), each (num_requests,) int64, drawn as the module docstring says."""
    rng = np.random.default_rng(spec.seed)

    def lognormal(mean: float) -> np.ndarray:
        mu = np.log(mean) - spec.sigma ** 2 / 2  # E[exp(N(mu, sigma^2))] = exp(mu + sigma^2 / 2) = mean
        return np.maximum(1, np.rint(rng.lognormal(mu, spec.sigma, spec.num_requests))).astype(np.int64)

    prompt = np.minimum(lognormal(spec.mean_prompt), max_seq_len - 1)
    output = np.minimum(lognormal(spec.mean_output), max_seq_len - prompt)
    return prompt, output


def _held(prompt: np.ndarray, output: np.ndarray) -> np.ndarray:
    """Positions held by each request at the end of each of its iterations, concatenated: P + t - 1."""
    return np.concatenate([np.arange(p, p + o) for p, o in zip(prompt.tolist(), output.tolist())])


def kv_utilization(prompt_lens, output_lens, scheme: str, max_seq_len: int = MAX_SEQ_LEN) -> float:
    """The time-averaged share (0..1) of reserved KV slots holding tokens under ``scheme`` ("max",
    "pow2", "oracle" or "paged_<block size>") for requests of these prompt and output lengths.

    Raises:
        ValueError: an unknown scheme, or no requests.
    """
    prompt, output = np.asarray(prompt_lens, dtype=np.int64), np.asarray(output_lens, dtype=np.int64)
    if prompt.size == 0:
        raise ValueError("prompt_lens: give at least one request")
    held = _held(prompt, output)
    final = np.repeat(prompt + output, output)  # each request's final length, once per iteration
    if scheme == "max":
        reserved = np.full_like(held, max_seq_len)
    elif scheme == "pow2":
        reserved = 2 ** np.ceil(np.log2(final)).astype(np.int64)
    elif scheme == "oracle":
        reserved = final
    elif scheme.startswith("paged_") and scheme[6:].isdigit() and int(scheme[6:]) > 0:
        bs = int(scheme[6:])
        reserved = blocks_for(held, bs) * bs
    else:
        raise ValueError(f"scheme: {scheme!r} is not max, pow2, oracle or paged_<block size>")
    return float(held.sum() / reserved.sum())


def run_lab(trace_names=tuple(TRACES), block_sizes=BLOCK_SIZES, max_seq_len: int = MAX_SEQ_LEN) -> dict:
    """The lab's report: ``{"traces": {name: {"schemes": {"max": x, "pow2": x, "oracle": x,
    "paged_1": x, ...}, "num_requests", "mean_prompt", "mean_output", "distribution"}}, "paper": {...},
    "max_seq_len", "block_sizes"}``, shares in 0..1 (see the module docstring).

    Raises:
        ValueError: an unknown trace name.
    """
    without_external = {s: PAPER[s] / (1 - PAPER_EXTERNAL[s]) for s in PAPER_EXTERNAL}
    report = {"traces": {}, "paper": dict(PAPER), "paper_without_external": without_external,
              "max_seq_len": max_seq_len, "block_sizes": list(block_sizes),
              "measure": "time-averaged share of reserved KV slots holding tokens"}
    for name in trace_names:
        if name not in TRACES:
            raise ValueError(f"trace: {name!r} is not one of {list(TRACES)}")
        spec = TRACES[name]
        prompt, output = make_trace(spec, max_seq_len)
        schemes = {s: kv_utilization(prompt, output, s, max_seq_len) for s in ("max", "pow2", "oracle")}
        for bs in block_sizes:
            schemes[f"paged_{bs}"] = kv_utilization(prompt, output, f"paged_{bs}", max_seq_len)
        report["traces"][name] = {
            "schemes": schemes, "num_requests": spec.num_requests,
            "mean_prompt": float(prompt.mean()), "mean_output": float(output.mean()),
            "distribution": f"log-normal, sigma {spec.sigma}, untruncated means {spec.mean_prompt} / "
                            f"{spec.mean_output}, seed {spec.seed}, cut to {max_seq_len} tokens",
        }
    return report


def format_table(report: dict) -> str:
    """The report as a text table: one row per scheme, one column per trace, the paper's Fig. 2 beside."""
    names = list(report["traces"])
    schemes = list(next(iter(report["traces"].values()))["schemes"]) if names else []
    head = f"{'scheme':<12}" + "".join(f"{n:>12}" for n in names) + f"{'paper':>12}{'w/o ext.':>12}"
    lines = ["Share of reserved KV memory holding tokens (time-averaged over each request's life)", head,
             "-" * len(head)]
    for s in schemes:
        paper = [f"{100 * report[k][s]:.1f}%" if s in report[k] else "" for k in ("paper", "paper_without_external")]
        lines.append(f"{s:<12}" + "".join(f"{100 * report['traces'][n]['schemes'][s]:>11.1f}%" for n in names)
                     + f"{paper[0]:>12}{paper[1]:>12}")
    for n in names:
        t = report["traces"][n]
        lines.append(f"{n}: {t['num_requests']} requests, mean prompt {t['mean_prompt']:.1f}, mean output "
                     f"{t['mean_output']:.1f} tokens ({t['distribution']})")
    lines.append("paper: Kwon et al. 2023, Fig. 2 (token states; Orca rows include external fragmentation, "
                 "which the lab does not model; w/o ext.: token states / (1 - external))")
    return "\n".join(lines)

"""Fragmentation: how much of the reserved KV memory holds tokens, under reservation and paging.

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
reserved_r(t), schedule independent: it needs only the lengths.

The traces: lengths drawn from log-normal distributions (sigma 1.0 in log space, mu set so that the
untruncated mean is the paper's), with a fixed seed, rounded to whole tokens, at least one token,
and each request cut to max_seq_len = 2,048 (output shortened). ShareGPT-like: mean prompt 161,
mean output 338; Alpaca-like: 19 and 58 (the paper's Sec. 6.1 statistics). The fragmentation lab
(``python -m minillm fragmentation``: every scheme and block size on both traces, the realised means,
the paper's numbers beside, and its figures) is ``minillm.lab.fragmentation``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .block_manager import blocks_for

MAX_SEQ_LEN = 2048


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

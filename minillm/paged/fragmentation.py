"""Fragmentation: how much of the reserved KV memory holds tokens, under reservation and paging
(Kwon et al. 2023, vLLM, Sec. 3 and Fig. 2). For a prompt of P tokens and O output tokens:

* "max" (Orca (Max)): ``max_seq_len`` slots; "pow2" (Orca (Pow2)): the next power of two at or above
  P + O; "oracle" (Orca (Oracle)): exactly P + O; all reserved from the start.
* "paged_<bs>": ``blocks_for(tokens held, bs) * bs`` slots, growing with the sequence (waste < bs slots).

A request lives O iterations and holds P + t - 1 positions at the end of iteration t; the time-averaged
share is sum_r sum_t held_r(t) / sum_r sum_t reserved_r(t), which needs only the lengths, not the schedule.
The traces (``make_trace``) follow the paper's Sec. 6.1 means; ``minillm.lab.fragmentation`` runs them.
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
    """(prompt_lens, output_lens), each (num_requests,) int64: log-normal lengths (mu set so that the
    untruncated mean is the spec's), seeded, at least one token, each request cut to ``max_seq_len``."""
    rng = np.random.default_rng(spec.seed)

    def lognormal(mean: float) -> np.ndarray:
        mu = np.log(mean) - spec.sigma ** 2 / 2  # E[exp(N(mu, sigma^2))] = exp(mu + sigma^2 / 2) = mean
        return np.maximum(1, np.rint(rng.lognormal(mu, spec.sigma, spec.num_requests))).astype(np.int64)

    prompt = np.minimum(lognormal(spec.mean_prompt), max_seq_len - 1)
    output = np.minimum(lognormal(spec.mean_output), max_seq_len - prompt)
    return prompt, output


def kv_utilization(prompt_lens, output_lens, scheme: str, max_seq_len: int = MAX_SEQ_LEN) -> float:
    """The time-averaged share (0..1) of reserved KV slots holding tokens under ``scheme`` ("max",
    "pow2", "oracle" or "paged_<block size>") for requests of these prompt and output lengths.

    Raises:
        ValueError: an unknown scheme, or no requests.
    """
    prompt, output = np.asarray(prompt_lens, dtype=np.int64), np.asarray(output_lens, dtype=np.int64)
    if prompt.size == 0:
        raise ValueError("prompt_lens: give at least one request")
    # positions each request holds at the end of each of its iterations (P + t - 1), concatenated
    held = np.concatenate([np.arange(p, p + o) for p, o in zip(prompt.tolist(), output.tolist())])
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

"""minillm.timing and minillm.roofline.ceilings: the timing rule (warm-up, median) and the byte and FLOP accounting of the
ceilings, checked with a fake clock so that the asserted numbers are exact, not timings."""

import pytest
import torch
from helpers import random_decoder

from minillm import timing
from minillm.roofline import ceilings


class FakeClock:
    """perf_counter that advances only when the timed function runs, by the next planned duration."""

    def __init__(self, durations):
        self.now, self.durations, self.calls = 0.0, list(durations), 0

    def perf_counter(self):
        return self.now

    def run(self):
        self.calls += 1
        self.now += self.durations.pop(0)


def test_time_median_skips_the_warmup_and_takes_the_median(monkeypatch):
    clock = FakeClock([100.0, 100.0, 3.0, 1.0, 2.0, 50.0, 4.0])  # two slow warm-up runs, then five timed
    monkeypatch.setattr(timing.time, "perf_counter", clock.perf_counter)
    assert timing.time_median(clock.run, repeats=5, warmup=2) == 3.0
    assert clock.calls == 7 and clock.durations == []


def test_ceilings_count_bytes_and_flops(monkeypatch):
    """With every timed call taking 0.5 s: a copy moves 2 x the buffer (read + write), a read 1 x, and an
    n x n matmul does 2 n^3 FLOPs."""
    calls = []

    def fake_time_median(fn, device="cpu", repeats=7, warmup=2):
        fn()
        calls.append(repeats)
        return 0.5

    monkeypatch.setattr(ceilings, "time_median", fake_time_median)
    c = ceilings.measure("cpu", dtypes=("float32", "bfloat16"), megabytes=4, matmul_n={"float32": 64}, repeats=6)
    nbytes = 4 * 2**20
    assert c.copy_bandwidth == 2 * nbytes / 0.5 and c.read_bandwidth == nbytes / 0.5
    assert c.bandwidth == c.copy_bandwidth  # the better of the two
    assert c.matmul_size == {"float32": 64, "bfloat16": 1024}  # CPU default for half types
    assert c.matmul_flops == {"float32": 2 * 64**3 / 0.5, "bfloat16": 2 * 1024**3 / 0.5}
    assert calls == [6, 6, 3, 3]  # the matmuls take half the repeats (at least 3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_measure_names_a_missing_gpu():
    with pytest.raises(ValueError, match="device: 'cuda' is not available here"):
        ceilings.measure("cuda")


def test_model_measurements_cover_what_they_are_asked_and_refuse_what_does_not_fit():
    small = random_decoder(300, max_seq_len=64)
    verify = timing.measure_verify(small, ks=(1, 2, 5), context=16, repeats=1)
    assert sorted(verify) == [1, 2, 5] and all(s > 0 for s in verify.values())
    assert timing.measure_decode(small, 2, context=8, steps=2, repeats=1) > 0
    assert timing.measure_prefill(small, 16, repeats=1) > 0
    with pytest.raises(ValueError, match="context 60 \\+ k 5: 65 positions do not fit the model's context of 64"):
        timing.measure_verify(small, ks=(1, 5), context=60)
    with pytest.raises(ValueError, match="batch_size: must be >= 1, got 0"):
        timing.measure_decode(small, 0)
    with pytest.raises(ValueError, match="prompt_tokens: 0 positions do not fit"):
        timing.measure_prefill(small, 0)

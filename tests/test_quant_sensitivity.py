"""The end-to-end sensitivity measurement of variable bitrate (minillm/quant/sensitivity.py), on a tiny
random model: the fast pass (rerun from the layer's block) equals the naive one (rerun everything)."""

import pytest
import torch

from minillm.quant.bitrate import optimize
from minillm.quant.sensitivity import ERROR, measure_logits, measure_logits_naive

from helpers import random_decoder

OPTIONS = [(2, 32), (4, 32)]


@pytest.fixture(scope="module")
def tiny():
    return random_decoder(300)


@pytest.fixture(scope="module")
def calib():
    return torch.randint(0, 300, (2, 48), generator=torch.Generator().manual_seed(0))


def test_the_fast_pass_equals_rerunning_the_whole_model(tiny, calib):
    fast = measure_logits(tiny, calib, OPTIONS, progress=False)
    naive = measure_logits_naive(tiny, calib, OPTIONS, progress=False)
    assert [r["name"] for r in fast["layers"]] == [r["name"] for r in naive["layers"]]
    for a, b in zip(fast["layers"], naive["layers"]):
        assert a["bits"] == b["bits"]
        assert a["errors"] == pytest.approx(b["errors"], rel=1e-4, abs=1e-7)
    assert fast["setup"]["error"] == ERROR


def test_kl_costs_are_positive_and_fall_with_more_bits(tiny, calib):
    table = measure_logits(tiny, calib, OPTIONS, progress=False)
    errs = torch.tensor([r["errors"] for r in table["layers"]])
    assert (errs > 0).all()
    assert (errs[:, 0] > errs[:, 1]).float().mean() > 0.9  # 2 bits cost more than 4 on nearly every layer


def test_the_optimizer_reads_a_kl_table(tiny, calib):
    table = measure_logits(tiny, calib, OPTIONS, progress=False)
    weights = sum(r["out_features"] * r["in_features"] for r in table["layers"])
    cheap, rich = (sum(r["bits"][k] for r in table["layers"]) / weights for k in (0, 1))
    mid = optimize(table, (cheap + rich) / 2, power=1.0, relative_to="output")
    assert cheap <= mid["bpw"] <= (cheap + rich) / 2
    assert sum(r["errors"][0] for r in table["layers"]) > mid["objective"] > sum(r["errors"][1] for r in table["layers"])


def test_bad_calibration_is_refused(tiny):
    with pytest.raises(ValueError, match="calib"):
        measure_logits(tiny, torch.zeros(48, dtype=torch.long), OPTIONS, progress=False)


def test_a_kl_table_is_optimized_with_its_own_power_and_no_block_norms(tiny, calib):
    from minillm.quant.bitrate import measure, table_errors, table_power

    kl = measure_logits(tiny, calib, OPTIONS, progress=False)
    assert table_power(kl) == 1.0 and kl["setup"]["end_to_end"]
    weights = sum(r["out_features"] * r["in_features"] for r in kl["layers"])
    bpw = sum(r["bits"][1] + r["bits"][0] for r in kl["layers"]) / 2 / weights
    assert optimize(kl, bpw) == optimize(kl, bpw, power=1.0, relative_to="output")
    assert table_errors(kl) == [r["errors"] for r in kl["layers"]]
    block = measure(tiny, calib, OPTIONS, error_windows=1, progress=False)
    assert table_power(block) == 2.0  # a block measurement keeps the squared errors
    stripped = {**block, "layers": [{k: v for k, v in r.items() if k != "out_norm"} for r in block["layers"]]}
    with pytest.raises(KeyError):  # a block table without its norms is not silently read as end to end
        optimize(stripped, bpw)


def test_bitrate_rows_refuses_an_unknown_quantizer_or_uniform_method(tiny):
    from minillm.lab.bitrate_rows import bitrate_rows

    with pytest.raises(ValueError, match="rtn or gptq"):
        bitrate_rows(tiny, None, {}, [3.0], method="awq")
    with pytest.raises(ValueError, match="smoothquant"):
        bitrate_rows(tiny, None, {}, [3.0], uniform=["smoothquant"])

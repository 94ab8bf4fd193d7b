"""Weight quantization: RTN, GPTQ, AWQ, packing, QuantLinear, the pipeline, GGUF block quantizers."""

import copy
import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, quants

from minillm.evaluation import perplexity, reference_logprobs
from minillm.quant import QuantConfig, rtn_quantize
from minillm.quant.awq import fold_scales, search_clip, search_scales
from minillm.fast import accelerate
from minillm.formats.gguf_quant import quantize_q4_0, quantize_q4_1, quantize_q8_0, write_gguf
from minillm.quant.gptq import Hessian, asymmetric_target, gptq_quantize, gptq_quantize_naive, inverse_hessian_cholesky
from minillm.quant.pack import pack_weight, pack_zeros, unpack_weight, unpack_zeros
from minillm.quant.checkpoint import load_quantized, save_quantized
from minillm.quant.pipeline import awq_scale_block, calibration_tokens, quantize_model
from minillm.quant.qlinear import QuantLinear, quant_linear_naive
from minillm.quant.recipe import AWQ_GPTQ, BEST, PAPER, Recipe

from helpers import random_decoder, write_tiny_gguf


def correlated(n=2048, dim=576, rank=48, seed=0):
    """Inputs with a few large, correlated channels, as real activations have."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, rank, generator=g) @ torch.randn(rank, dim, generator=g) * 0.3
    x[:, :8] *= 10  # outlier channels
    return x + 0.1 * torch.randn(n, dim, generator=g)


def hessian(x):
    h = Hessian(x.shape[1])
    h.add_batch(x)
    return h.H


def out_err(x, w_hat, w):
    return ((x @ (w_hat - w).t()).norm() / (x @ w.t()).norm()).item()


# ---- RTN --------------------------------------------------------------------------------------

def test_rtn_hand_computed():
    w = torch.tensor([[0.0, 1.0, 2.0, 3.0], [-1.0, -0.5, 0.5, 1.0]])
    qw = rtn_quantize(w, QuantConfig(bits=2, group_size=-1))
    # row 0: range [0, 3], scale 1, zero 0 -> exact; row 1: range [-1, 1], scale 2/3, zero round(1.5) = 2
    assert qw.codes[0].tolist() == [0, 1, 2, 3] and qw.zeros[:, 0].tolist() == [0, 2]
    assert qw.codes[1].tolist() == [0, 1, 3, 3]  # -0.5/(2/3) = -0.75 -> -1 (+2 = 1); 1/(2/3) = 1.5 -> 2 (+2 = 4 -> 3)
    s = 1365 / 2048  # 2/3 rounded to float16 (0.66650...): the scale the checkpoint stores
    assert qw.scales[1, 0].item() == s and torch.equal(qw.scales, qw.scales.half().float())
    torch.testing.assert_close(qw.dequantize()[1], torch.tensor([-2 * s, -s, s, s]))


def test_rtn_symmetric_keeps_zero_at_the_middle_code():
    w = torch.tensor([[-2.0, 0.0, 1.0, 2.0]])
    qw = rtn_quantize(w, QuantConfig(bits=4, group_size=-1, sym=True))
    assert qw.zeros.item() == 8 and qw.codes[0, 1].item() == 8
    assert qw.dequantize()[0, 1].item() == 0.0


def test_partial_last_group_is_handled():
    w = torch.randn(8, 576)
    qw = rtn_quantize(w, QuantConfig(bits=4, group_size=128))
    assert qw.scales.shape == (8, 5)  # 4 groups of 128 and one of 64
    assert qw.g_idx[-64:].tolist() == [4] * 64 and qw.g_idx[511].item() == 3
    # the last group's scale comes from its 64 columns only
    alone = rtn_quantize(w[:, 512:], QuantConfig(bits=4, group_size=-1))
    torch.testing.assert_close(qw.scales[:, 4], alone.scales[:, 0])


@pytest.mark.parametrize("sym", [False, True])
def test_mse_range_search_never_loses_to_min_max(sym):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(32, 64, generator=g)
    plain, searched = QuantConfig(3, 32, sym, mse=False), QuantConfig(3, 32, sym, mse=True)
    err = {c.mse: ((rtn_quantize(w, c).dequantize() - w).abs() ** 2.4).reshape(32, 2, 32).sum(-1) for c in (plain, searched)}
    assert (err[True] <= err[False] * (1 + 1e-6)).all()  # p = 1 (min / max) is on the grid
    assert err[True].sum() < 0.9 * err[False].sum()  # 3-bit Gaussian groups: a narrower range pays
    assert (rtn_quantize(w, searched).scales <= rtn_quantize(w, plain).scales * (1 + 1e-6)).all()


def test_rtn_error_falls_with_bits_and_smaller_groups():
    w = torch.randn(64, 576)
    err = {(b, g): (rtn_quantize(w, QuantConfig(b, g)).dequantize() - w).norm().item()
           for b in (2, 3, 4, 8) for g in (32, -1)}
    assert err[(2, 32)] > err[(3, 32)] > err[(4, 32)] > err[(8, 32)]
    assert all(err[(b, 32)] < err[(b, -1)] for b in (2, 3, 4, 8))


def test_bad_configs_are_refused():
    with pytest.raises(ValueError, match="bits"):
        QuantConfig(bits=1)
    with pytest.raises(ValueError, match="group_size"):
        QuantConfig(group_size=0)
    with pytest.raises(ValueError, match="NaN"):
        rtn_quantize(torch.tensor([[float("nan"), 1.0]]), QuantConfig(4, -1))


# ---- GPTQ -------------------------------------------------------------------------------------

def test_inverse_hessian_cholesky_hand_computed():
    # H = [[4, 2], [2, 3]]: H^-1 = [[3/8, -1/4], [-1/4, 1/2]] = U^T U with U upper triangular
    U = inverse_hessian_cholesky(torch.tensor([[4.0, 2.0], [2.0, 3.0]], dtype=torch.float64), percdamp=0.0)
    expected = torch.tensor([[math.sqrt(3 / 8), -0.25 / math.sqrt(3 / 8)], [0.0, 1 / math.sqrt(3)]], dtype=torch.float64)
    torch.testing.assert_close(U, expected)
    # dampening adds 1% of the mean diagonal (3.5) to the diagonal before inverting
    U = inverse_hessian_cholesky(torch.tensor([[4.0, 2.0], [2.0, 3.0]], dtype=torch.float64), percdamp=0.01)
    Hd = torch.tensor([[4.035, 2.0], [2.0, 3.035]], dtype=torch.float64)
    torch.testing.assert_close(U.t() @ U, torch.linalg.inv(Hd))


CASES = [dict(), dict(act_order=True), dict(act_order=True, static_groups=True)]
FULL = "act_order+static_groups"


@pytest.mark.parametrize("group_size,opts", [  # make test-fast keeps the case with every option
    pytest.param(g, c, id=f"{g}-{name}", marks=[] if (g, name) == (128, FULL) else pytest.mark.slow)
    for name, c in zip(["plain", "act_order", FULL], CASES) for g in [64, 128, -1]])
def test_gptq_does_not_depend_on_block_size_and_equals_the_naive_obs_loop(opts, group_size):
    x = correlated(dim=320)
    w = torch.randn(48, 320)
    H, cfg = hessian(x), QuantConfig(4, group_size)
    ref = gptq_quantize(w, H, cfg, blocksize=128, **opts)
    for bs in (1, 7, 320):
        other = gptq_quantize(w, H, cfg, blocksize=bs, **opts)
        assert torch.equal(other.codes, ref.codes) and torch.equal(other.scales, ref.scales), bs
    naive = gptq_quantize_naive(w, H, cfg, **opts)
    assert (naive.codes == ref.codes).float().mean() > 0.999  # same algorithm, different float rounding
    assert out_err(x, naive.dequantize(), w) == pytest.approx(out_err(x, ref.dequantize(), w), rel=1e-3)


@pytest.mark.parametrize("bits,group_size", [(4, 64), (4, -1), (3, 64), (2, 32)])
def test_gptq_output_error_is_below_rtn_on_correlated_inputs(bits, group_size):
    x, w = correlated(), torch.randn(96, 576) * 0.05
    cfg = QuantConfig(bits, group_size)
    rtn = out_err(x, rtn_quantize(w, cfg).dequantize(), w)
    gptq = out_err(x, gptq_quantize(w, hessian(x), cfg, act_order=True).dequantize(), w)
    assert gptq < 0.7 * rtn


def test_dead_inputs_give_no_nan_and_zero_weights():
    x = correlated(dim=128)
    x[:, [3, 50]] = 0  # two inputs that are always zero
    H = hessian(x)
    assert H[3, 3] == 0
    w = torch.randn(16, 128)
    qw = gptq_quantize(w, H, QuantConfig(4, 32), act_order=True)
    w_hat = qw.dequantize()
    assert torch.isfinite(w_hat).all()
    assert (w_hat[:, [3, 50]] == 0).all()


def test_act_order_g_idx():
    x = correlated(dim=256)
    H = hessian(x)
    qw = gptq_quantize(torch.randn(32, 256), H, QuantConfig(4, 64), act_order=True)
    perm = torch.argsort(torch.diag(H), descending=True)
    # group k holds the k-th run of 64 columns in decreasing order of diag(H)
    assert qw.g_idx[perm].tolist() == [j // 64 for j in range(256)]
    assert not torch.equal(qw.g_idx, torch.arange(256) // 64)  # really permuted
    static = gptq_quantize(torch.randn(32, 256), H, QuantConfig(4, 64), act_order=True, static_groups=True)
    assert static.g_idx.tolist() == [j // 64 for j in range(256)]


def test_gptq_refuses_mismatched_hessian():
    with pytest.raises(ValueError, match="H"):
        gptq_quantize(torch.randn(4, 8), torch.eye(7), QuantConfig(4, -1))


def test_asymmetric_target_is_the_least_squares_weight_onto_the_float_outputs():
    """GPTQv2's target W* = W + W dXXT H^-1 maps the quantized model's inputs X onto W X_f, the float
    model's outputs: the least-squares solution (no dampening)."""
    g = torch.Generator().manual_seed(5)
    x_f = correlated(n=1024, dim=64, rank=16)
    x = x_f + 0.05 * torch.randn(x_f.shape, generator=g)  # the quantized model's inputs: the float ones plus error
    w = torch.randn(24, 64, generator=g)
    h = Hessian(64)
    h.add_batch(x[:500], x_f[:500])
    h.add_batch(x[500:], x_f[500:])  # two batches: H and dXXT rescale together
    target = asymmetric_target(w, h.H, h.dXXT, percdamp=0.0)
    lstsq = torch.linalg.lstsq(x.double(), (x_f @ w.t()).double()).solution.t()
    # H and dXXT sum float32 products: agreement to 1% of the correction W* - W (which is ~1e-2 of W)
    assert (target - lstsq).abs().max() < 1e-2 * (lstsq - w).abs().max()
    assert torch.equal(asymmetric_target(w, h.H, torch.zeros_like(h.H)), w.double())  # no input error: W itself


def test_dampened_asymmetric_target_is_the_ridge_regression_toward_w():
    """With dampening p the target minimises ||W X_f - W' X||^2 + lam ||W' - W||^2, lam = p mean(diag H) n / 2
    (H = 2 X^T X / n): the ridge that pulls the least-squares weight back toward W, more as p grows."""
    g = torch.Generator().manual_seed(7)
    x_f = correlated(n=300, dim=64, rank=16)
    x = x_f + 0.2 * torch.randn(x_f.shape, generator=g)
    w = torch.randn(24, 64, generator=g)
    h = Hessian(64)
    h.add_batch(x, x_f)
    dist = {}
    for p in (0.01, 0.3):
        lam = p * torch.diag(h.H).mean().item() * x.shape[0] / 2
        A = torch.cat([x.double(), lam ** 0.5 * torch.eye(64, dtype=torch.float64)])
        B = torch.cat([(x_f @ w.t()).double(), lam ** 0.5 * w.t().double()])
        ridge = torch.linalg.lstsq(A, B).solution.t()
        target = asymmetric_target(w, h.H, h.dXXT, percdamp=p)
        assert (target - ridge).abs().max() < 1e-2 * (ridge - w).abs().max()
        dist[p] = (target - w).norm().item()
    assert dist[0.3] < 0.7 * dist[0.01]


def test_v2_fits_the_float_outputs_better_than_the_paper_objective():
    g = torch.Generator().manual_seed(6)
    x_f = correlated(n=2048, dim=256)
    x = x_f + 0.3 * x_f.abs().mean() * torch.randn(x_f.shape, generator=g)  # the earlier layers' error
    w = torch.randn(64, 256, generator=g) * 0.05
    h = Hessian(256)
    h.add_batch(x, x_f)
    cfg = QuantConfig(4, 64)
    err = {}
    for name, target in (("paper", w), ("v2", asymmetric_target(w, h.H, h.dXXT, 0.01))):
        w_hat = gptq_quantize(target, h.H, cfg, act_order=True).dequantize()
        err[name] = ((x @ w_hat.t() - x_f @ w.t()).norm() / (x_f @ w.t()).norm()).item()
    assert err["v2"] < 0.7 * err["paper"]  # measured: 0.075 vs 0.148


def test_bits_per_weight_counts_float16_scales_and_zeros():
    assert QuantConfig(4, 64).bits_per_weight(576) == 4 + 20 * 9 / 576  # 4.3125
    assert QuantConfig(4, 128).bits_per_weight(576) == 4 + 20 * 5 / 576  # a shorter fifth group still has a scale
    assert QuantConfig(3, 32).bits_per_weight(1536) == 3 + 19 / 32
    assert QuantConfig(4, -1).bits_per_weight(576) == 4 + 20 / 576


@pytest.mark.parametrize("method", ["rtn", "gptq", "awq", "awq+gptq"])
def test_every_method_stores_float16_scales(tiny, tmp_path, method):
    from safetensors import safe_open

    model = copy.deepcopy(tiny[0])
    report = quantize_model(model, Recipe.of(method, bits=4, group_size=32), tiny_inputs(model)[0], progress=False)
    for m in model.modules():
        if isinstance(m, QuantLinear):
            assert torch.equal(m.scales, m.scales.half().float())  # the error measured is the error stored
    path = save_quantized(model, tmp_path / "q.safetensors", report)
    with safe_open(str(path), "pt") as f:
        assert f.get_tensor("layers.0.attn.wqkv.scales").dtype == torch.float16
    loaded = load_quantized(path)[0]
    assert torch.equal(loaded.layers[1].mlp.w_down.dequantize(), model.layers[1].mlp.w_down.dequantize())


def test_save_refuses_scales_float16_cannot_hold(tiny, tmp_path):
    model = copy.deepcopy(tiny[0])
    report = quantize_model(model, Recipe.of("rtn", bits=4, group_size=32), progress=False)
    with torch.inference_mode():
        model.layers[0].attn.wo.scales[0, 0] = 0.1  # not a float16 value
    with pytest.raises(ValueError, match="not float16 values"):
        save_quantized(model, tmp_path / "q.safetensors", report)
    assert not (tmp_path / "q.safetensors").exists()


def test_quantize_model_defaults_are_the_measured_best_and_the_paper_is_one_recipe_away(tiny):
    """The method's defaults (``Recipe.of``) are BEST for gptq, AWQ_GPTQ for awq+gptq and
    the plain fields for rtn / awq; PAPER and BEST differ in exactly the fields recipe.py's docstring names."""
    from dataclasses import fields

    import minillm.quant.recipe as recipe_module

    calib = tiny_inputs(tiny[0])[0]
    rep = quantize_model(copy.deepcopy(tiny[0]), Recipe.of("gptq", bits=4, group_size=32), calib, progress=False)
    assert {k: rep[k] for k in BEST.preset_fields()} == BEST.preset_fields()
    assert Recipe.of("gptq", bits=4, group_size=32) == replace(BEST, group_size=32)
    assert Recipe.of("gptq", "paper") == PAPER and Recipe.of("awq+gptq") == AWQ_GPTQ == replace(BEST, method="awq+gptq", v2=False, v2_percdamp=None)
    rep = quantize_model(copy.deepcopy(tiny[0]), replace(PAPER, group_size=32), calib, progress=False)
    assert {k: rep[k] for k in PAPER.preset_fields()} == PAPER.preset_fields()
    assert (rep["act_order"], rep["mse"], rep["percdamp"], rep["true_sequential"], rep["v2"]) == (False, False, 0.01, False, False)
    differ = {f.name for f in fields(Recipe) if getattr(PAPER, f.name) != getattr(BEST, f.name)}
    assert differ == set(recipe_module.PRESET_FIELDS) == {"act_order", "mse", "percdamp", "true_sequential", "v2", "v2_percdamp"}
    assert all(f"``{name}``" in recipe_module.__doc__ for name in differ)  # the docstring names each
    assert quantize_model(copy.deepcopy(tiny[0]), Recipe.of("rtn", bits=4, group_size=32), progress=False)["mse"] is False
    both = quantize_model(copy.deepcopy(tiny[0]), Recipe.of("awq+gptq", bits=4, group_size=32), calib, progress=False)
    assert both["v2"] is False and both["v2_percdamp"] is None and both["act_order"] is True  # v2 not measured after AWQ
    with pytest.raises(ValueError, match="v2"):
        quantize_model(copy.deepcopy(tiny[0]), Recipe.of("awq", bits=4, group_size=32, v2=True), calib, progress=False)
    untouched = copy.deepcopy(tiny[0])
    with pytest.raises(ValueError, match=r"v2_percdamp: must be in \[0, 1\)"):
        quantize_model(untouched, Recipe.of("gptq", bits=4, group_size=32, v2=True, v2_percdamp=1.0), calib,
                       progress=False)
    assert not any(isinstance(m, QuantLinear) for m in untouched.modules())  # refused before any layer changed
    with pytest.raises(TypeError, match="act_order"):  # the recipe holds every option
        quantize_model(untouched, BEST, calib, act_order=False)


@pytest.mark.parametrize("kwargs, message", [
    ({"method": "smoothquant"}, "method: 'smoothquant'"),
    ({"method": "gptq", "bits": 9}, "bits: must be an integer in 2..8"),
    ({"method": "gptq", "group_size": 0}, "group_size: must be -1"),
    ({"method": "gptq", "percdamp": 1.0}, r"percdamp: must be in \[0, 1\)"),
    ({"method": "rtn", "act_order": True}, "act_order: the column order is a GPTQ option; rtn does not use it"),
    ({"method": "awq", "static_groups": True}, "static_groups: .* awq does not use it"),
    ({"method": "awq", "v2": True, "v2_percdamp": 0.3}, "v2: asymmetric calibration is a GPTQ option"),
    ({"method": "gptq", "awq_clip": True}, "awq_clip: AWQ's clip search; gptq does not use it"),
    ({"method": "gptq", "v2": True}, "v2_percdamp: v2 needs"),
    ({"method": "gptq", "v2_percdamp": 0.1}, "v2_percdamp: dampens GPTQv2's correction, which is off"),
    ({"method": "gptq", "v2": True, "v2_percdamp": -0.1}, r"v2_percdamp: must be in \[0, 1\)"),
    ({"method": "awq", "awq_tokens": 0}, "awq_tokens: must be a positive integer"),
    ({"method": "rtn", "quant_head": "int2"}, "quant_head: 'int2'"),
])
def test_a_recipe_is_checked_in_one_place_and_the_error_names_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Recipe(**kwargs)


def test_recipe_of_applies_options_over_the_methods_start_and_refuses_the_unused_ones():
    assert Recipe.of("gptq") == BEST and Recipe.of("rtn") == Recipe("rtn") and Recipe.of("awq", mse=None) == Recipe("awq")
    assert Recipe.of("gptq", v2=False) == replace(BEST, v2=False, v2_percdamp=None)  # v2 off drops its dampening
    assert Recipe.of("gptq", "paper", v2=True).v2_percdamp == BEST.v2_percdamp  # v2 on takes BEST's
    assert Recipe.of("awq+gptq", "paper") == replace(PAPER, method="awq+gptq")
    assert Recipe.of("gptq", config=QuantConfig(3, -1, mse=None)) == replace(BEST, bits=3, group_size=-1)
    for method, options, flags in (("rtn", {"act_order": False}, "--act-order"), ("awq", {"percdamp": 0.01}, "--percdamp"),
                                   ("gptq", {"awq_clip": False}, "--awq-clip"), ("rtn", {"recipe": "paper"}, "--recipe")):
        preset = options.pop("recipe", None)
        with pytest.raises(ValueError, match=f"quant: {method} does not use {flags}"):
            Recipe.of(method, preset, **options)
    with pytest.raises(ValueError, match="recipe: 'exact' is not one of"):
        Recipe.of("gptq", "exact")


@pytest.mark.parametrize("true_sequential", [True, False])
def test_v2_pipeline_fits_the_float_models_outputs(tiny, true_sequential):
    """With v2 the first block's layers see no input error (X = X_float there), so its qkv codes equal the
    plain run's; later blocks get the float model's inputs beside the quantized ones and change."""
    from minillm.quant.pipeline import linear_of

    calib = tiny_inputs(tiny[0])[0]
    runs = {}
    for v2 in (False, True):
        m = copy.deepcopy(tiny[0])
        rep = quantize_model(m, Recipe.of("gptq", bits=4, group_size=32, v2=v2, true_sequential=true_sequential), calib,
                             progress=False)
        assert rep["v2"] is v2 and rep["true_sequential"] is true_sequential
        runs[v2] = m
    codes = lambda m, i, name: linear_of(m.layers[i], name)[0].quantized_weight().codes
    assert torch.equal(codes(runs[True], 0, "attn.wqkv"), codes(runs[False], 0, "attn.wqkv"))
    last = len(tiny[0].layers) - 1
    assert not torch.equal(codes(runs[True], last, "mlp.w_down"), codes(runs[False], last, "mlp.w_down"))


def test_v2_options_reach_the_layer_alpha_scales_and_v2_percdamp_dampens_the_target_only(tiny):
    """A layer quantized by the pipeline's quantizer with v2 is GPTQ (dampening percdamp) on the target
    ``asymmetric_target(W, H, dXXT, v2_percdamp, v2_alpha)``; v2_alpha 0 gives the plain layer."""
    from minillm.quant.pipeline import LayerQuantizer, linear_of

    g = torch.Generator().manual_seed(8)
    x_f = torch.randn(2, 16, tiny[0].config.ffn_dim, generator=g)
    x = x_f + 0.3 * torch.randn(x_f.shape, generator=g)
    cfg = QuantConfig(4, 32, mse=True)
    plain = Recipe("gptq", 4, 32, mse=True, act_order=True, percdamp=0.001)

    def layer(**v2):
        block = copy.deepcopy(tiny[0].layers[0])
        quantizer = LayerQuantizer(tiny[0], replace(plain, **v2), fast=False)
        return quantizer(block, 0, "mlp.w_down", x, x_f).quantized_weight().codes

    W = linear_of(tiny[0].layers[0], "mlp.w_down")[0].weight.float()
    h = Hessian(W.shape[1])
    h.add_batch(x, x_f)
    for alpha, damp in ((1.0, 0.1), (0.5, None)):
        expected = gptq_quantize(asymmetric_target(W, h.H, h.dXXT, BEST.v2_percdamp if damp is None else damp, alpha),
                                 h.H, cfg, percdamp=0.001, act_order=True).codes
        assert torch.equal(layer(v2=True, v2_alpha=alpha, v2_percdamp=BEST.v2_percdamp if damp is None else damp), expected)
    codes = layer()
    assert torch.equal(layer(v2=True, v2_alpha=0.0, v2_percdamp=BEST.v2_percdamp), codes)
    assert not torch.equal(layer(v2=True, v2_percdamp=0.1), codes)


def test_paper_gptq_is_the_reference_loop_on_the_float_blocks_inputs(tiny):
    """With the paper's settings, every layer of block b is GPTQ (``gptq_quantize``, 1% dampening, no
    act-order, min/max) on the Hessian of its inputs in one pass of the float block b, fed by the blocks
    before it already quantized; the default (true sequential) calibrates later layers on the quantized
    earlier ones instead, which changes their codes."""
    from minillm.quant.pipeline import block_inputs, layer_inputs, linear_of, LAYERS

    model, calib = copy.deepcopy(tiny[0]), tiny_inputs(tiny[0])[0]
    X, rope, mask = block_inputs(model, calib)
    cfg = QuantConfig(4, 32, mse=False)
    expected = {}
    for i, block in enumerate(model.layers):
        ins, _ = layer_inputs(block, i, X, rope, mask)
        for name in LAYERS:
            lin, parent, attr = linear_of(block, name)
            qw = gptq_quantize(lin.weight.float(), hessian(ins[name].reshape(-1, lin.in_features)), cfg, percdamp=0.01)
            expected[f"{i}.{name}"] = qw.codes
            setattr(parent, attr, (model.quant_linear_class or QuantLinear)(qw, lin.bias))  # as the pipeline builds
        X = block(X, i, rope, None, mask)
    paper, seq = copy.deepcopy(tiny[0]), copy.deepcopy(tiny[0])
    quantize_model(paper, replace(PAPER, group_size=32), calib, progress=False)
    quantize_model(seq, replace(PAPER, group_size=32, true_sequential=True), calib, progress=False)
    for i in range(len(model.layers)):
        for name in LAYERS:
            assert torch.equal(linear_of(paper.layers[i], name)[0].quantized_weight().codes, expected[f"{i}.{name}"])
    assert not torch.equal(linear_of(seq.layers[0], "mlp.w_down")[0].quantized_weight().codes, expected["0.mlp.w_down"])


# ---- packing and QuantLinear ------------------------------------------------------------------

@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_pack_round_trip(bits):
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 1 << bits, (37, 101), generator=g, dtype=torch.int32)
    q = pack_weight(codes, bits)
    assert q.dtype == torch.int32 and q.shape == (math.ceil(101 / (32 // bits)), 37)
    assert torch.equal(unpack_weight(q, bits, 101), codes)
    zeros = torch.randint(0, 1 << bits, (37, 5), generator=g, dtype=torch.int32)
    assert torch.equal(unpack_zeros(pack_zeros(zeros, bits), bits, 37), zeros)


def test_pack_order_is_documented_order():
    codes = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 15]])  # one output row, 8 inputs -> one word
    word = pack_weight(codes, 4)[0, 0].item() & 0xFFFFFFFF
    assert word == 0xF7654321  # first input in the lowest nibble
    with pytest.raises(ValueError, match="codes"):
        pack_weight(torch.tensor([[16]]), 4)


@pytest.mark.parametrize("opts", CASES[:2], ids=["plain", "act_order"])
@pytest.mark.parametrize("bits,group_size", [(4, 32), (4, 64), (4, 128), (4, -1), (3, 64), (8, 32), (4, 48)])
def test_quant_linear_dequantizes_bit_exactly_and_fast_path_agrees(bits, group_size, opts):
    x = correlated(n=512)
    w = torch.randn(96, 576) * 0.05
    qw = gptq_quantize(w, hessian(x), QuantConfig(bits, group_size), **opts)
    layer = QuantLinear(qw, bias=torch.randn(96))
    assert torch.equal(layer.dequantize(), qw.dequantize())  # pack -> unpack -> dequantize, bit for bit
    y_ref = quant_linear_naive(x[:5], layer)
    torch.testing.assert_close(y_ref, x[:5] @ qw.dequantize().t() + layer.bias)
    assert layer.fast == (bits <= 4 and group_size != 48)  # 48 is not made of kernel groups of 32..256
    y = layer(x[:5])
    assert ((y - y_ref).norm() / y_ref.norm()).item() < 2e-2  # bfloat16 activations in the kernel


def test_quant_linear_storage_is_small():
    layer = QuantLinear(rtn_quantize(torch.randn(1536, 576), QuantConfig(4, 64)))
    assert layer.nbytes() < 0.16 * 1536 * 576 * 4  # 4-bit codes + float32 scales + 4-bit zeros per 64


# ---- AWQ --------------------------------------------------------------------------------------

def test_awq_search_is_never_worse_than_rtn_and_protects_salient_channels():
    x, w = correlated(n=1024), torch.randn(128, 576) * 0.05
    cfg = QuantConfig(3, 64)
    s, alpha, errors = search_scales(x, [w], cfg)
    assert errors[0] == pytest.approx(((x @ rtn_quantize(w, cfg).dequantize().t() - x @ w.t()) ** 2).mean().item(), rel=1e-4)
    assert min(errors) <= errors[0] and alpha > 0
    assert s[:8].mean() > s[8:].mean()  # the outlier channels get the larger scales


def test_awq_clip_lowers_output_error():
    x, w = correlated(n=512), torch.randn(64, 576) * 0.05
    w[:, 100] *= 8  # a few large weights stretch their groups' ranges
    cfg = QuantConfig(3, 32)
    clipped = search_clip(w, x, cfg)
    assert out_err(x, rtn_quantize(clipped, cfg).dequantize(), w) < out_err(x, rtn_quantize(w, cfg).dequantize(), w)


def test_fold_scales_keeps_a_layer_pair_equal():
    g = torch.Generator().manual_seed(0)
    prev, w, x = torch.randn(64, 32, generator=g), torch.randn(16, 64, generator=g), torch.randn(5, 32, generator=g)
    y = (x @ prev.t()) @ w.t()  # prev's rows produce the inputs w reads
    prev2, w2 = prev.clone(), w.clone()
    fold_scales(prev2, [w2], torch.rand(64, generator=g) + 0.5)
    assert not torch.equal(w2, w)
    torch.testing.assert_close((x @ prev2.t()) @ w2.t(), y, rtol=1e-4, atol=1e-4 * y.abs().max().item())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from minillm import load_model

    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    write_tiny_gguf(path)
    model, _ = load_model(path)
    return model, path


def tiny_inputs(model, n=4, T=32):
    calib = torch.randint(0, model.config.vocab_size, (n, T), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(T)
    return calib, (model.rope_cos[pos], model.rope_sin[pos]), pos[None, :] <= pos[:, None]


@pytest.mark.parametrize("mha", [False, True])
def test_awq_folding_leaves_the_float_model_unchanged(tiny, tmp_path, mha):
    """Scales folded into the norms, the up rows (and the v rows when H == Hkv) change no logit."""
    from minillm import load_model

    from helpers import TINY

    if mha:
        cfg = dict(TINY, n_kv_heads=TINY["n_heads"])
        path = tmp_path / "mha.gguf"
        from helpers import tiny_llama_weights
        write_tiny_gguf(path, tiny_llama_weights(cfg=cfg), cfg=cfg)
        model = load_model(path)[0]
    else:
        model = copy.deepcopy(tiny[0])
    calib, rope, mask = tiny_inputs(model)
    before = model(calib, torch.arange(calib.shape[1]))
    X = model.embed(calib)
    alphas = []
    for i, block in enumerate(model.layers):
        alphas += awq_scale_block(model, block, i, X, rope, mask, QuantConfig(3, 32), 10, 1024)
        X = block(X, i, rope, None, mask)
    assert len(alphas) == model.config.n_layers * (4 if mha else 3)
    assert any(a["awq_alpha"] > 0 for a in alphas)  # something was really scaled
    torch.testing.assert_close(model(calib, torch.arange(calib.shape[1])), before, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("method", ["rtn", "gptq", "awq", "awq+gptq"])
def test_pipeline_quantizes_every_layer_and_round_trips_through_safetensors(tiny, tmp_path, method):
    model = copy.deepcopy(tiny[0])
    calib = tiny_inputs(model)[0]
    tokens = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(1))
    before = model(tokens, torch.arange(40))
    report = quantize_model(model, Recipe.of(method, bits=4, group_size=32), calib, progress=False)
    assert sum(isinstance(m, QuantLinear) for m in model.modules()) == 4 * model.config.n_layers
    assert all(0 < r["rel_error"] < 0.5 for r in report["layers"] if "rel_error" in r)
    after = model(tokens, torch.arange(40))
    assert 0 < (after - before).abs().max() < 0.5 * before.abs().max()
    path = save_quantized(model, tmp_path / "q.safetensors", report)
    loaded, meta = load_quantized(path)
    assert meta["quant_config"]["method"] == method
    accelerate(loaded)  # the same kernels as the accelerated model it was written from
    torch.testing.assert_close(loaded(tokens, torch.arange(40)), after)


def test_an_untied_output_layer_round_trips_through_safetensors(tmp_path):
    """A model with its own output layer (TinyLlama's kind): its float head, reassembled from column shards, is
    saved and loaded back."""
    from minillm.model import Decoder

    tied = random_decoder(96)
    state = {k: v for k, v in _decoder_state(tied).items()}
    state["output.weight"] = torch.randn(96, tied.config.dim, generator=torch.Generator().manual_seed(3)) / 8
    model = Decoder(replace(tied.config, tie_embeddings=False), state).eval()
    tokens = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(1))
    report = quantize_model(model, Recipe.of("rtn", bits=4, group_size=32), tokens, progress=False)
    loaded, _ = load_quantized(save_quantized(model, tmp_path / "untied.safetensors", report))
    assert not loaded.config.tie_embeddings
    torch.testing.assert_close(loaded(tokens, torch.arange(12)), model(tokens, torch.arange(12)))


def _decoder_state(model) -> dict:
    """The float state ``Decoder(config, state)`` takes, read back from a built float model."""
    state = {"tok_embeddings.weight": model.embedding_weight(), "norm.weight": model.norm.weight}
    for i, block in enumerate(model.layers):
        p = f"layers.{i}"
        D, Hkv = block.attn.head_dim, block.attn.n_kv_heads
        wq, wk, wv = block.attn.wqkv.weight.split([block.attn.n_heads * D, Hkv * D, Hkv * D])
        gate, up = block.mlp.w_gate_up.weight.chunk(2)
        state.update({f"{p}.attn_norm.weight": block.attn_norm.weight, f"{p}.ffn_norm.weight": block.ffn_norm.weight,
                      f"{p}.attn.wq.weight": wq, f"{p}.attn.wk.weight": wk, f"{p}.attn.wv.weight": wv,
                      f"{p}.attn.wo.weight": block.attn.wo.weight, f"{p}.mlp.w_gate.weight": gate,
                      f"{p}.mlp.w_up.weight": up, f"{p}.mlp.w_down.weight": block.mlp.w_down.weight})
    return {k: v.detach().clone() for k, v in state.items()}


def test_awq_clip_default_skips_the_clip_only_before_gptq_with_range_search(tiny):
    """AWQ+GPTQ with mse: AWQ's scales, then GPTQ on the unclipped weights (clipping first would change the
    target); without mse, and for AWQ alone, the clip search runs."""
    calib = tiny_inputs(tiny[0])[0]

    def run(method, mse, **kw):
        m = copy.deepcopy(tiny[0])
        rep = quantize_model(m, Recipe.of(method, bits=3, group_size=32, mse=mse, **kw), calib, progress=False)
        return rep["awq_clip"], [mod.qweight.clone() for mod in m.modules() if isinstance(mod, QuantLinear)]

    def same(a, b):
        return all(torch.equal(x, y) for x, y in zip(a[1], b[1]))

    for method, mse, clips in (("awq+gptq", True, False), ("awq+gptq", False, True), ("awq", False, True)):
        default, off, on = run(method, mse), run(method, mse, awq_clip=False), run(method, mse, awq_clip=True)
        assert default[0] is clips and off[0] is False and on[0] is True
        assert same(default, on if clips else off) and not same(on, off)
    assert run("gptq", True)[0] is False


def test_load_quantized_refuses_other_files(tmp_path):
    from safetensors.torch import save_file

    from minillm.errors import ModelFileError

    save_file({"x": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ModelFileError, match="not a minillm quantized model"):
        load_quantized(tmp_path / "other.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"\x00" * 10)
    with pytest.raises(ModelFileError, match="junk"):
        load_quantized(tmp_path / "junk.safetensors")


def test_pipeline_errors():
    from minillm.model import Decoder  # noqa: F401

    with pytest.raises(ValueError, match="method"):
        quantize_model(None, Recipe.of("smoothquant"))


@pytest.mark.parametrize("recipe, calib, call", [
    ("rtn", QuantConfig(4, 32), "Recipe.of('rtn', config=QuantConfig(bits=4, group_size=32, sym=False, mse=None))"),
    (QuantConfig(3, 64), None, "Recipe.of('rtn', config=QuantConfig(bits=3, group_size=64, sym=False, mse=None))"),
    ("gptq", None, "Recipe.of('gptq', config=QuantConfig(4, 32))"),
])
def test_quantize_model_takes_a_recipe_and_names_the_call_that_builds_one(tiny, recipe, calib, call):
    """A method name or a QuantConfig where the Recipe goes is refused before any layer changes, with the call
    that means it."""
    model = copy.deepcopy(tiny[0])
    with pytest.raises(TypeError, match="pass a Recipe") as e:
        quantize_model(model, recipe, calib, progress=False)
    assert call in str(e.value) and "recipe.PAPER / recipe.BEST" in str(e.value)
    assert not any(isinstance(m, QuantLinear) for m in model.modules())


# ---- GGUF block formats -----------------------------------------------------------------------

GGUF_QUANTIZERS = [(quantize_q8_0, Q.Q8_0), (quantize_q4_0, Q.Q4_0), (quantize_q4_1, Q.Q4_1)]


@pytest.mark.parametrize("fn,qtype", GGUF_QUANTIZERS, ids=lambda v: getattr(v, "name", ""))
def test_gguf_quantizers_are_bit_exact_with_the_gguf_package(fn, qtype, model):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 256, generator=g) * 0.05
    x[0, :32] = 0  # an all-zero block
    x[1, :32] = torch.arange(32) * 0.5  # exact halves (rounding ties)
    x[2, 7] = -x[2, :32].abs().max() * 2  # a negative largest magnitude
    real = model.layers[0].mlp.w_down.weight[:64]  # a real weight (dequantized Q4_1)
    for w in (x, real):
        assert np.array_equal(fn(w), quants.quantize(w.numpy(), qtype))
    with pytest.raises(ValueError, match="multiple of the block size"):
        fn(torch.zeros(2, 48))


def test_q8_0_requantizes_the_embedded_embedding_losslessly(model, reader):
    t = next(t for t in reader.tensors if t.name == "token_embd.weight")
    assert t.tensor_type == Q.Q8_0
    assert np.array_equal(quantize_q8_0(model.embedding_weight()).reshape(-1), np.asarray(t.data).reshape(-1))


@pytest.mark.parametrize("qtype,file_type", [("Q8_0", 7), ("Q4_0", 2), ("Q4_1", 3)])
def test_write_gguf_round_trip(tmp_path, qtype, file_type):
    from minillm import load_model
    from minillm.formats import gguf_blocks

    src = tmp_path / "tiny.gguf"
    write_tiny_gguf(src)  # without general.file_type, as some converters write
    dst = write_gguf(src, tmp_path / f"tiny-{qtype}.gguf", qtype)
    a, b = GGUFReader(src), GGUFReader(dst)
    kept = {f for f in a.fields if not f.startswith("GGUF.")}
    assert "general.file_type" not in kept
    assert {f for f in b.fields if not f.startswith("GGUF.")} == kept | {"general.file_type"}
    assert b.fields["general.file_type"].contents() == file_type  # llama_ftype's LLAMA_FTYPE_MOSTLY_<qtype>
    fn = dict((q.name, f) for f, q in GGUF_QUANTIZERS)[qtype]
    for ta, tb in zip(a.tensors, b.tensors):
        shape = tuple(int(s) for s in reversed(ta.shape))
        w = gguf_blocks.dequantize(ta.data, ta.tensor_type, shape)
        if len(shape) == 2:
            assert tb.tensor_type == Q[qtype]
            assert np.array_equal(np.asarray(tb.data), fn(w))
            torch.testing.assert_close(gguf_blocks.dequantize(tb.data, tb.tensor_type, shape),
                                       torch.from_numpy(quants.dequantize(fn(w), Q[qtype])).reshape(shape))
        else:
            assert np.array_equal(np.asarray(tb.data), np.asarray(ta.data))
    load_model(dst)  # minillm reads it back as a model
    with pytest.raises(ValueError, match="qtype"):
        write_gguf(src, tmp_path / "x.gguf", "Q5_K")


# ---- evaluation -------------------------------------------------------------------------------

def test_kl_of_a_model_to_itself_is_zero_and_grows_with_quantization_error(tiny):
    model = tiny[0]
    tokens = torch.randint(0, model.config.vocab_size, (256,), generator=torch.Generator().manual_seed(2)).tolist()
    ref = reference_logprobs(model, tokens, 64)
    same = perplexity(model, tokens, 64, reference=ref)
    assert abs(same["kl"]) < 1e-6 and same["top1_agreement"] == 1.0
    kl = {}
    for bits in (2, 8):
        q = copy.deepcopy(model)
        quantize_model(q, Recipe.of("rtn", bits=bits, group_size=32), progress=False)
        kl[bits] = perplexity(q, tokens, 64, reference=ref)["kl"]
    assert kl[2] > 10 * kl[8] > 0
    with pytest.raises(ValueError, match="reference"):
        perplexity(model, tokens, 32, reference=ref)


def test_calibration_tokens_are_seeded_windows_of_the_calibration_play(tokenizer):
    a = calibration_tokens(tokenizer, 4, 64, seed=0)
    assert a.shape == (4, 64) and torch.equal(a, calibration_tokens(tokenizer, 4, 64, seed=0))
    assert not torch.equal(a, calibration_tokens(tokenizer, 4, 64, seed=1))


def test_avenues_name_real_options_and_recovery_is_the_issues_formula():
    import dataclasses

    from minillm.lab.avenues import AVENUES, gptq_avenues, recovery

    assert recovery(31.0, 36.0, 29.0) == pytest.approx(5 / 7)  # (RTN - method) / (RTN - float)
    fields = {f.name for f in dataclasses.fields(Recipe)}
    for name, (_, over) in AVENUES.items():
        assert set(over) - {"calib", "recipe"} <= fields, name
        Recipe.of("gptq", over.get("recipe"), **{k: v for k, v in over.items() if k not in ("calib", "recipe")})
    with pytest.raises(ValueError, match="unknown"):
        gptq_avenues(None, None, ["smoothquant"])

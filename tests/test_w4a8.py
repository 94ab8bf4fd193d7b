"""The int4 product with int8 activations (minillm.fast.kernels.int4_a8_linear, llama.cpp's Q4 x Q8 recipe) against
its naive twin, inside QuantLinear (quantize_activations) and under torch.compile."""

import pytest
import torch

from minillm.fast import kernels
from minillm.quant import QuantConfig, rtn_quantize
from minillm.quant.activations import quantize_activations
from minillm.quant.gptq import Hessian, gptq_quantize
from minillm.fast.quant import FastQuantLinear as QuantLinear  # the speed layer's, against the reference path
from minillm.quant.qlinear import quant_linear_naive, quantize_q8

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"kernels off: {kernels.why_unavailable()}")


def _layer(rows, n, k, gs, zero_points, seed=0):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g)
    scales = torch.rand(k // gs, n, generator=g) * 0.1
    zeros = torch.randint(0, 16, scales.shape, generator=g).float() if zero_points else None
    x = torch.randn(rows, k, generator=g)
    x[:, 5] *= 30  # one large input per row: its block's scale is coarse, the others' are not
    return x, codes, scales, zeros


def _bound(x, codes, scales, zeros, gs):
    """float32 rounding bound of the kernel's sums: a few ulps of every term's size, the zero point's included
    (s q and s z are summed apart, then subtracted)."""
    q = codes.double() + (0 if zeros is None else zeros.t().double().repeat_interleave(gs, 1))
    w = scales.t().double().repeat_interleave(gs, 1) * q
    return 1e-5 * (x.abs().double() @ w.t()) + 1e-6


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 9])
@pytest.mark.parametrize("n,k,gs", [(32, 64, 32), (96, 256, 64), (64, 384, 128)])
@pytest.mark.parametrize("zero_points", [True, False])
def test_int4_a8_linear_equals_its_naive_twin(rows, n, k, gs, zero_points):
    x, codes, scales, zeros = _layer(rows, n, k, gs, zero_points, seed=rows * 7 + n)
    sz = None if zeros is None else scales * zeros
    y = kernels.int4_a8_linear(x, kernels.int4_a8_panels(codes), scales, sz, gs)
    ref = kernels.int4_a8_linear_naive(x.double(), codes, scales.double(), None if zeros is None else zeros.double(), gs)
    assert y.shape == (rows, n)
    assert ((y.double() - ref).abs() <= _bound(x, codes, scales, zeros, gs)).all()
    # the rounding of x is real: the float product differs by far more than the bound
    exact = kernels.int4_linear_naive(x.double(), codes, scales.double(), None if zeros is None else zeros.double(), gs)
    assert (ref - exact).norm() / exact.norm() > 1e-3


def test_int4_a8_rows_do_not_depend_on_the_batch():
    x, codes, scales, zeros = _layer(9, 96, 256, 64, True)
    args = (kernels.int4_a8_panels(codes), scales, scales * zeros, 64)
    batch = kernels.int4_a8_linear(x, *args)
    for m in range(9):
        assert torch.equal(kernels.int4_a8_linear(x[m:m + 1], *args), batch[m:m + 1])


def test_quantize_q8_is_llamacpps_q8_0():
    x = torch.tensor([[0.0] * 32 + [1.0, -2.0, 0.5] + [0.0] * 29])
    q, d = quantize_q8(x)
    assert torch.equal(d, torch.tensor([[0.0, 2.0]]) / 127)
    assert q[0, :32].eq(0).all() and q[0, 32:35].tolist() == [64, -127, 32]  # 63.5 -> 64 (ties to even), 31.75 -> 32


def test_int4_a8_panels_put_each_code_where_the_kernel_reads_it():
    codes = torch.randint(0, 16, (64, 64))
    packed = kernels.int4_a8_panels(codes)  # (2, 2, 512)
    assert packed.shape == (2, 2, 512) and packed.dtype == torch.uint8
    for n, kk in ((0, 0), (7, 3), (8, 17), (31, 63), (32, 40), (63, 29)):
        t, j, c = n // 32, (n % 32) // 8, n % 8
        b, r = kk // 32, kk % 32
        half, l, i = r // 16, (r % 16) // 4, r % 4
        byte = int(packed[t, b, (j * 4 + l) * 32 + 4 * c + i])
        assert (byte >> (4 * half)) & 0xF == codes[n, kk]


def test_int4_a8_linear_refuses_what_it_cannot_take():
    x, codes, scales, zeros = _layer(2, 32, 64, 32, False)
    packed = kernels.int4_a8_panels(codes)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernels.int4_a8_linear(x, packed, scales, None, 16)
    with pytest.raises(RuntimeError, match="shapes"):
        kernels.int4_a8_linear(x[:, :32], packed, scales, None, 32)
    assert kernels.int4_a8_linear(torch.zeros(3, 64), packed, scales, None, 32).eq(0).all()  # all-zero blocks: d = 0


def _quant_layer(act_order=False, bits=4, group_size=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(256, 256, generator=g)
    h = Hessian(256)
    h.add_batch(x)
    qw = gptq_quantize(torch.randn(96, 256, generator=g) * 0.05, h.H, QuantConfig(bits, group_size), act_order=act_order)
    return QuantLinear(qw, bias=torch.randn(96, generator=g)), x


def test_quantize_activations_puts_the_layer_on_the_kernel_and_its_reference_rounds_too():
    layer, x = _quant_layer()
    plain = layer(x[:3])
    model = torch.nn.Sequential(layer)
    assert quantize_activations(model) == 1 and layer.kernel == "minillm-int4-a8"
    for rows in (1, 3, 8, 40):
        y, ref = layer(x[:rows]), quant_linear_naive(x[:rows], layer)
        assert ((y - ref).abs() <= 1e-5 * (x[:rows].abs() @ layer.dequantize().abs().t() * 8) + 1e-5).all()
    assert 1e-4 < ((layer(x[:3]) - plain).norm() / plain.norm()).item() < 5e-2  # x's rounding, about 1%


def test_act_order_layers_round_in_input_order_on_the_float_kernel():
    layer, x = _quant_layer(act_order=True)
    quantize_activations(torch.nn.Sequential(layer))
    assert layer.kernel == "minillm-int4"  # the int8 kernel's blocks would follow the permuted order
    y, ref = layer(x[:4]), quant_linear_naive(x[:4], layer)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


def test_quantize_activations_refuses_other_widths_and_models_without_4_bit_layers():
    layer, _ = _quant_layer(bits=8, group_size=-1)
    with pytest.raises(ValueError, match="no 4-bit"):
        quantize_activations(torch.nn.Sequential(layer))
    with pytest.raises(ValueError, match="8 bits"):
        quantize_activations(torch.nn.Sequential(layer), bits=4)


def test_int4_a8_runs_inside_torch_compile():
    layer = QuantLinear(rtn_quantize(torch.randn(64, 128) * 0.05, QuantConfig(4, 64)))
    quantize_activations(torch.nn.Sequential(layer))
    x = torch.randn(3, 128)
    compiled = torch.compile(lambda x: torch.relu(layer(x)), fullgraph=True)
    torch.testing.assert_close(compiled(x), torch.relu(layer(x)))


def test_a_nan_or_an_infinity_in_a_block_reaches_the_output():
    x, codes, scales, zeros = _layer(3, 32, 64, 32, True)
    x[0, 3], x[1, 40] = float("nan"), float("inf")
    y = kernels.int4_a8_linear(x, kernels.int4_a8_panels(codes), scales, scales * zeros, 32)
    assert y[0].isnan().all() and y[1].isnan().all() and y[2].isfinite().all()  # as the float product: NaN, inf - inf


def test_the_ops_refuse_a_backward_and_rounding_passes_gradients_straight_through():
    x, codes, scales, _ = _layer(2, 32, 64, 32, False)
    x.requires_grad_()
    y = torch.ops.minillm.int4_a8_linear(x, kernels.int4_a8_panels(codes), scales, None, 32)
    with pytest.raises(RuntimeError, match="no backward"):
        y.sum().backward()
    layer, xs = _quant_layer()
    quantize_activations(torch.nn.Sequential(layer))
    xg = xs[:2].clone().requires_grad_()
    layer(xg).sum().backward()  # the reference path, rounding as the kernel does: the gradient of the unrounded x
    torch.testing.assert_close(xg.grad, layer.dequantize().sum(0).expand(2, -1))


def test_quantize_activations_drops_a_compiled_decode(tmp_path):
    from helpers import write_tiny_gguf

    from minillm.fast.compiled import compile_decode, is_compiled
    from minillm.loading import load_model
    from minillm.quant import Recipe, quantize_model

    write_tiny_gguf(tmp_path / "tiny.gguf")
    model = load_model(tmp_path / "tiny.gguf")[0]
    quantize_model(model, Recipe.of("rtn", bits=4, group_size=32), progress=False)
    compile_decode(model)  # its guards leave the modules out: a stale graph would run the old kernels
    quantize_activations(model)
    assert not is_compiled(model)

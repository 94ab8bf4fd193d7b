"""minillm's own AVX2 int4/int8 kernels (minillm.fast.kernels) against their naive baselines, inside
QuantLinear, under torch.compile, and the fallback to torch's kernels."""

import pytest
import torch

from minillm.fast import kernels
from minillm.quant import QuantConfig, rtn_quantize
from minillm.quant.gptq import Hessian, gptq_quantize
from minillm.fast.quant import FastQuantLinear as QuantLinear  # the speed layer's, against the reference path
from minillm.quant.qlinear import quant_linear_naive

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"kernels off: {kernels.why_unavailable()}")


def bound(x, w):
    """float32 rounding bound of x w^T: a few ulps of sum |x| |w| (so a wrong code or scale shows)."""
    return 1e-5 * (x.abs() @ w.abs().t()) + 1e-6


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 11, 12, 13, 15, 19, 22, 30, 100, 130, 200, 400])
@pytest.mark.parametrize("out_features,in_features,group_size", [(32, 64, 32), (96, 256, 64), (64, 384, 128)])
@pytest.mark.parametrize("zero_points", [True, False])
def test_int4_linear_equals_dequantize_then_matmul(rows, out_features, in_features, group_size, zero_points):
    g = torch.Generator().manual_seed(rows * 1000 + out_features)
    codes = torch.randint(0, 16, (out_features, in_features), generator=g)
    scales = torch.rand(in_features // group_size, out_features, generator=g) * 0.1
    zeros = torch.randint(0, 16, scales.shape, generator=g).float() if zero_points else None
    x = torch.randn(rows, in_features, generator=g)
    y = kernels.int4_linear(x, kernels.int4_panels(codes), scales, zeros, group_size)
    ref = kernels.int4_linear_naive(x.double(), codes, scales.double(), None if zeros is None else zeros.double(),
                                    group_size)
    w = kernels.int4_linear_naive(torch.eye(in_features), codes, scales, zeros, group_size).t()  # (N, K) dequantized
    assert y.shape == (rows, out_features)
    assert ((y.double() - ref).abs() <= bound(x, w).double()).all()


@pytest.mark.parametrize("rows", [1, 12, 50, 383, 384])
def test_products_over_no_inputs_are_zero(rows):
    """K = 0: every output is an empty sum, on every path (registers, panels, chunked GEMM)."""
    x = torch.randn(rows, 0)
    y4 = kernels.int4_linear(x, kernels.int4_panels(torch.zeros(32, 0, dtype=torch.long)), torch.zeros(0, 32), None, 32)
    y8 = kernels.int8_linear(x, kernels.int8_panels(torch.zeros(32, 0, dtype=torch.int8)), torch.ones(32), torch.ones(32))
    assert torch.equal(y4, torch.zeros(rows, 32)) and torch.equal(y8, torch.zeros(rows, 32))


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512", reason="the 16-lane loop needs AVX-512")
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 11])
@pytest.mark.parametrize("zero_points", [True, False])
def test_int4_linear_16_and_8_lanes_give_the_same_floats(rows, zero_points):
    """The few-row loop in AVX-512's 16 lanes and in AVX2's 8 adds the same products in the same order per column,
    so where both run the AVX2 path (what a CPU without AVX-512 runs) is checked bit for bit against it."""
    g = torch.Generator().manual_seed(rows)
    codes = torch.randint(0, 16, (96, 256), generator=g)
    scales = torch.rand(4, 96, generator=g) * 0.1
    zeros = torch.randint(0, 16, scales.shape, generator=g).float() if zero_points else None
    x, panels = torch.randn(rows, 256, generator=g), kernels.int4_panels(codes)
    wide = kernels.int4_linear(x, panels, scales, zeros, 64, lanes=16)
    assert torch.equal(kernels.int4_linear(x, panels, scales, zeros, 64, lanes=8), wide)
    assert torch.equal(kernels.int4_linear(x, panels, scales, zeros, 64), wide)
    with pytest.raises(RuntimeError, match="lanes must be"):
        kernels.int4_linear(x, panels, scales, zeros, 64, lanes=4)


@pytest.mark.parametrize("rows", [1, 5, 11, 12, 100, 200])
def test_codes_at_their_zero_point_do_not_cancel(rows):
    """Codes within one of the zero point and activations with a large mean: the product is small beside the
    terms a kernel could sum separately (s x.q and s z sum(x), which cancelled to ~1e-3 before z left the codes)."""
    g = torch.Generator().manual_seed(rows)
    zeros = torch.full((4, 96), 8.0)
    codes = 8 + torch.randint(-1, 2, (96, 256), generator=g)
    scales = torch.rand(4, 96, generator=g) * 0.1 + 0.01
    x = 100 + torch.randn(rows, 256, generator=g)
    y = kernels.int4_linear(x, kernels.int4_panels(codes), scales, zeros, 64)
    ref = kernels.int4_linear_naive(x.double(), codes, scales.double(), zeros.double(), 64)
    # float32 rounding of the products themselves: about 3e-7 here (the separate sums gave 1.3e-5 to 2.1e-5)
    assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 1e-6


@pytest.mark.parametrize("rows", [1, 3, 6, 9, 12, 14, 15, 100, 130, 200])
@pytest.mark.parametrize("with_offset", [True, False])
def test_int8_linear_equals_dequantize_then_matmul(rows, with_offset):
    g = torch.Generator().manual_seed(rows)
    codes = torch.randint(-128, 128, (96, 160), generator=g).to(torch.int8)
    scales = torch.rand(96, generator=g) * 0.01
    offset = torch.randn(96, generator=g) * 0.01 if with_offset else None
    x = torch.randn(rows, 160, generator=g)
    y = kernels.int8_linear(x, kernels.int8_panels(codes), scales, offset)
    ref = kernels.int8_linear_naive(x.double(), codes, scales.double(), None if offset is None else offset.double())
    w = kernels.int8_linear_naive(torch.eye(160), codes, scales, offset).t()
    assert ((y.double() - ref).abs() <= bound(x, w).double()).all()


def test_int4_panels_put_each_code_where_the_kernel_reads_it():
    codes = torch.randint(0, 16, (64, 8))
    panels = kernels.int4_panels(codes)  # (2, 8, 4)
    words = panels.to(torch.int64) & 0xFFFFFFFF
    for n, k in ((0, 0), (7, 3), (8, 0), (31, 7), (32, 1), (63, 5)):
        t, j, i = n // 32, (n % 32) // 8, n % 8
        assert (words[t, k, j] >> (4 * i)) & 0xF == codes[n, k]


@pytest.mark.parametrize("bits,group_size,act_order", [(4, 64, False), (4, 64, True), (3, 128, False), (2, 32, True),
                                                     (4, -1, False), (8, -1, False)])
def test_quant_linear_takes_our_kernel_within_float32_rounding_of_its_reference(bits, group_size, act_order):
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(512, 256, generator=g)
    x[:, :4] *= 8
    h = Hessian(256)
    h.add_batch(x)
    qw = gptq_quantize(torch.randn(96, 256, generator=g) * 0.05, h.H, QuantConfig(bits, group_size), act_order=act_order)
    layer = QuantLinear(qw, bias=torch.randn(96, generator=g))
    assert layer.kernel == ("minillm-int8" if bits == 8 else "minillm-int4")
    for rows in (1, 5, 8, 12, 20, 200, 400):  # each path: registers, panels (blocks of 48 and 192), chunked GEMM
        y, ref = layer(x[:rows]), quant_linear_naive(x[:rows], layer)
        assert ((y - ref).abs() <= bound(x[:rows], layer.dequantize()) + 1e-5).all()  # torch's: bfloat16's 1e-2


def test_our_kernel_runs_inside_torch_compile():
    layer = QuantLinear(rtn_quantize(torch.randn(64, 128) * 0.05, QuantConfig(4, 64)))
    x = torch.randn(3, 128)
    compiled = torch.compile(lambda x: torch.relu(layer(x)), fullgraph=True)  # fullgraph: no break at the op
    torch.testing.assert_close(compiled(x), torch.relu(layer(x)))


def test_minillm_kernels_0_keeps_torchs_kernels(monkeypatch):
    monkeypatch.setenv("MINILLM_KERNELS", "0")
    monkeypatch.setattr(kernels, "_state", {})
    assert kernels.why_unavailable() == "MINILLM_KERNELS=0" and not kernels.available()
    layer = QuantLinear(rtn_quantize(torch.randn(64, 128) * 0.05, QuantConfig(4, 64)))
    assert layer.kernel == "torch-int4"
    x = torch.randn(2, 128)
    ref = quant_linear_naive(x, layer)
    assert ((layer(x) - ref).norm() / ref.norm()).item() < 2e-2  # bfloat16 activations


def test_a_failed_build_warns_and_falls_back(monkeypatch):
    import torch.utils.cpp_extension as ext

    def broken(*args, **kwargs):
        raise RuntimeError("Error building extension 'minillm_cpu_kernels'")
    monkeypatch.setattr(ext, "load", broken)
    monkeypatch.setattr(kernels, "_state", {})
    with pytest.warns(UserWarning, match="kernels are off: the build failed"):
        assert kernels.load() is None
    assert QuantLinear(rtn_quantize(torch.randn(64, 128), QuantConfig(4, 64))).kernel == "torch-int4"


def test_two_checkouts_of_the_same_sources_build_apart(monkeypatch):
    here = kernels.build_name()
    assert here == kernels.build_name()  # the same checkout finds its build again
    monkeypatch.setattr(kernels, "__file__", "/another/checkout/minillm/kernels/__init__.py")
    assert kernels.build_name() != here  # torch's build file holds absolute source paths: one folder each


def test_a_first_build_is_announced_and_a_built_one_is_not(monkeypatch, tmp_path, capsys):
    import torch.utils.cpp_extension as ext

    monkeypatch.setattr(ext, "_get_build_directory", lambda name, verbose: str(tmp_path))
    kernels._announce_build("minillm_cpu_kernels_x")
    assert "building its CPU kernels" in capsys.readouterr().err
    (tmp_path / "minillm_cpu_kernels_x.so").write_bytes(b"")
    kernels._announce_build("minillm_cpu_kernels_x")
    assert capsys.readouterr().err == ""


@pytest.mark.slow  # builds in a new interpreter
def test_the_build_command_make_setup_runs_says_what_it_did():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "minillm.fast.kernels"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "minillm kernels: built and loaded" in out.stdout, out.stderr
    off = subprocess.run([sys.executable, "-m", "minillm.fast.kernels"], capture_output=True, text=True, timeout=60,
                         env={**__import__("os").environ, "MINILLM_KERNELS": "0"})
    assert off.returncode == 0 and "off (MINILLM_KERNELS=0)" in off.stdout


def test_bad_arguments_raise_instead_of_crashing_or_broadcasting():
    panels4 = kernels.int4_panels(torch.randint(0, 16, (32, 64)))
    with pytest.raises(RuntimeError, match="group_size"):  # was an integer division by zero: SIGFPE
        kernels.int4_linear(torch.randn(2, 64), panels4, torch.rand(1, 32), None, 0)
    panels8 = kernels.int8_panels(torch.randint(-128, 128, (32, 64)).to(torch.int8))
    with pytest.raises(RuntimeError, match="scales"):  # one scale for 32 columns was broadcast silently
        kernels.int8_linear(torch.randn(2, 64), panels8, torch.rand(1), None)
    with pytest.raises(RuntimeError, match="offset"):
        kernels.int8_linear(torch.randn(2, 64), panels8, torch.rand(32), torch.rand(1))


def test_calling_a_product_without_the_extension_says_why(monkeypatch):
    monkeypatch.setenv("MINILLM_KERNELS", "0")
    monkeypatch.setattr(kernels, "_state", {})
    with pytest.raises(RuntimeError, match="MINILLM_KERNELS=0"):  # was: 'NoneType' has no attribute 'int4_linear'
        kernels.int4_linear(torch.randn(2, 64), kernels.int4_panels(torch.randint(0, 16, (32, 64))),
                            torch.rand(1, 32), None, 64)


def test_a_pickled_layer_rebuilds_its_kernel_where_it_lands(monkeypatch):
    import pickle

    layer = QuantLinear(rtn_quantize(torch.randn(64, 128) * 0.05, QuantConfig(4, 64)))
    blob = pickle.dumps(layer)
    assert pickle.loads(blob).kernel == "minillm-int4"
    monkeypatch.setenv("MINILLM_KERNELS", "0")  # a process where minillm's kernels are off
    monkeypatch.setattr(kernels, "_state", {})
    there = pickle.loads(blob)
    assert there.kernel == "torch-int4"
    x = torch.randn(2, 128)
    ref = quant_linear_naive(x, there)
    assert ((there(x) - ref).norm() / ref.norm()).item() < 2e-2


def test_gradients_take_the_reference_path():
    layer = QuantLinear(rtn_quantize(torch.randn(64, 128) * 0.05, QuantConfig(4, 64)))
    x = torch.randn(3, 128, requires_grad=True)
    layer(x).sum().backward()
    x2 = x.detach().clone().requires_grad_()
    quant_linear_naive(x2, layer).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)


def test_a_second_thread_waits_for_the_first_build(monkeypatch):
    import threading
    import time
    import torch.utils.cpp_extension as ext

    real = kernels.load()
    monkeypatch.setattr(ext, "load", lambda *a, **k: (time.sleep(0.5), real)[1])  # a slow first build
    monkeypatch.setattr(kernels, "_state", {})
    got = [None, None]
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, kernels.load())) for i in range(2)]
    for t in threads:
        t.start()
        time.sleep(0.1)
    for t in threads:
        t.join()
    assert got == [real, real]


def test_load_state_dict_rebuilds_the_kernels_copy():
    layer = QuantLinear(rtn_quantize(torch.randn(64, 128) * 0.05, QuantConfig(4, 64)))
    other = QuantLinear(rtn_quantize(torch.randn(64, 128) * 0.05, QuantConfig(4, 64)))
    layer.load_state_dict(other.state_dict())  # buffers written in place: the packed copy was left stale
    x = torch.randn(3, 128)
    torch.testing.assert_close(layer(x), quant_linear_naive(x, other), rtol=1e-5, atol=1e-5)


def test_a_layer_moved_to_meta_has_no_kernel_and_comes_back():
    layer = QuantLinear(rtn_quantize(torch.randn(64, 128) * 0.05, QuantConfig(4, 64)))
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    assert layer.to("meta").kernel == "reference"  # was: bincount has no meta kernel
    layer.load_state_dict(state, assign=True)  # materialized from a checkpoint, as a model built on meta is
    assert layer.kernel in ("minillm-int4", "torch-int4")
    x = torch.randn(3, 128)
    torch.testing.assert_close(layer(x), quant_linear_naive(x, layer), rtol=2e-2, atol=2e-2)


def test_to_empty_leaves_the_kernel_for_load_state_dict():
    layer = QuantLinear(rtn_quantize(torch.randn(64, 128) * 0.05, QuantConfig(4, 64)))
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    layer.to("meta").to_empty(device="cpu")  # uninitialised buffers: packing them raised (bincount) at random
    layer.load_state_dict(state)
    x = torch.randn(3, 128)
    assert layer.kernel == "minillm-int4"
    torch.testing.assert_close(layer(x), quant_linear_naive(x, layer), rtol=1e-5, atol=1e-5)

"""minillm's few-row float32 product (kernels/dense.cpp) against its naive twin, and Linear's choice of it."""

import pytest
import torch

from minillm.fast import kernels, linear
from minillm.fast import accelerate
from minillm.fast.linear import FastLinear as Linear  # the speed layer's, against the library's baseline
from minillm.linear import linear_naive

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"kernels off: {kernels.why_unavailable()}")
LANES = [8, 16] if torch.backends.cpu.get_cpu_capability() == "AVX512" else [8]


def _bound(x, shards):
    """The float32 rounding of a K-term sum: K eps times the sum of |x| |w| (a sum in another order lands within it)."""
    K = shards.shape[1]
    return K * torch.finfo(torch.float32).eps * (x.abs() @ kernels.f32_linear_naive(torch.eye(K), shards).abs())


@pytest.mark.parametrize("S,K,Ns", [(2, 576, 480), (1, 100, 64), (3, 7, 32), (2, 1536, 96)])
@pytest.mark.parametrize("M", [1, 2, 6, 7, 8, 9, 17, 30, 53])
def test_f32_linear_equals_its_naive_twin(S, K, Ns, M):
    torch.manual_seed(M)
    w, x = torch.randn(S, K, Ns), torch.randn(M, K)
    ref = kernels.f32_linear_naive(x, w)
    for lanes in LANES:  # K = 7 and 100 end inside a block (48, 96 or 192 rows of W^T by M), 1536 spans several
        for tiles in (False, True):  # in blocks of rows of W^T, or in tiles of columns
            assert ((kernels.f32_linear(x, w, lanes, tiles) - ref).abs() <= _bound(x, w)).all()


@pytest.mark.parametrize("M", [1, 8, 13])
def test_f32_linear_tiles_split_one_shard_across_threads(M):
    """With one shard and two threads each takes a run of its tiles (the last one asks for no next tile): every
    column is written once, with the floats of the order by blocks."""
    torch.manual_seed(M)
    w, x = torch.randn(1, 50, 6400), torch.randn(M, 50)
    by_tiles, by_blocks = kernels.f32_linear(x, w, 0, True), kernels.f32_linear(x, w, 0, False)
    assert torch.equal(by_tiles, by_blocks)
    assert ((by_tiles - kernels.f32_linear_naive(x, w)).abs() <= _bound(x, w)).all()


def test_f32_linear_rows_do_not_depend_on_the_batch():
    """Each output adds its products in one order whatever M and whichever lanes: a row alone, in a batch of 13
    or of 60 (longer blocks of W^T), or in 8- and 16-lane code gives the same floats (what makes a verification's
    logits equal a decode step's)."""
    torch.manual_seed(0)
    w, x = torch.randn(2, 576, 288), torch.randn(60, 576)
    alone = torch.cat([kernels.f32_linear(x[i:i + 1], w) for i in range(60)])
    assert torch.equal(kernels.f32_linear(x, w), alone)
    assert torch.equal(kernels.f32_linear(x[:13], w), alone[:13])
    for lanes in LANES:
        assert torch.equal(kernels.f32_linear(x, w, lanes), alone)
        for m in (1, 2, 13, 25, 60):  # tiles: 60 rows in chunks of 12 (6 in 8 lanes), 25 as 9 + 8 + 8
            assert torch.equal(kernels.f32_linear(x[:m], w, lanes, tiles=True), alone[:m])


def test_f32_linear_refusals_name_the_problem():
    w = torch.randn(2, 16, 32)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernels.f32_linear(torch.randn(1, 16), torch.randn(2, 16, 40))
    with pytest.raises(RuntimeError, match=r"x \(M, K\)"):
        kernels.f32_linear(torch.randn(1, 17), w)
    with pytest.raises(RuntimeError, match="float32"):
        kernels.f32_linear(torch.randn(1, 16, dtype=torch.float64), w)
    with pytest.raises(RuntimeError, match="lanes"):
        kernels.f32_linear(torch.randn(1, 16), w, 4)
    assert kernels.f32_linear(torch.randn(0, 16), w).shape == (0, 64)


@pytest.mark.parametrize("rows", sorted({1, 3, 4, 5, linear.FEW_ROWS, linear.FEW_ROWS + 1}))
def test_linear_takes_the_few_row_kernel_up_to_its_limit(monkeypatch, rows):
    torch.manual_seed(rows)
    layer = Linear(torch.randn(192, 64), torch.randn(192), n_shards=2)
    calls = []
    real = kernels.f32_linear
    monkeypatch.setattr(kernels, "f32_linear", lambda *a, **k: calls.append(k) or real(*a, **k))
    x = torch.randn(1, rows, 64)
    with torch.inference_mode():
        y = layer(x)
    assert y.shape == (1, rows, 192)
    assert calls == ([{"tiles": linear.KERNEL_TILES}] if rows <= linear.FEW_ROWS else [])
    assert torch.allclose(y, linear_naive(x, layer), atol=1e-5)


@pytest.mark.parametrize("capability, vendor, few, tiles", [
    ("AVX512", "GenuineIntel", 96, False), ("AVX512", "AuthenticAMD", 48, True), ("AVX2", "GenuineIntel", 4, False),
    ("AVX2", "AuthenticAMD", 24, True), ("AVX512", "", 4, False)])
def test_few_rows_follows_the_cpu(monkeypatch, capability, vendor, few, tiles):
    """Where the few-row kernel was measured ahead (docs/decode.md): 96 rows on Intel's AVX-512 in blocks of 48
    rows of W^T and more; on AMD's CPUs in tiles, up to 48 rows with AVX-512 and 24 with AVX2; 4 with AVX2 on
    Intel or an unknown vendor."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(linear, "_cpu_vendor", lambda: vendor)
    assert (linear._few_rows(), linear._kernel_tiles()) == (few, tiles)


def test_linear_keeps_torch_for_gradients_and_odd_widths(monkeypatch):
    monkeypatch.setattr(kernels, "f32_linear", lambda *a: pytest.fail("the kernel ran"))
    layer = Linear(torch.randn(96, 16), n_shards=2)  # 48 columns per shard: not a multiple of 32
    layer(torch.randn(2, 16))
    torch.manual_seed(0)
    layer = Linear(torch.randn(64, 16))
    x = torch.randn(2, 16, requires_grad=True)
    layer(x).sum().backward()
    torch.testing.assert_close(x.grad, layer.weight.sum(0).expand(2, -1))  # float32's tolerances: sums differ in order


def test_bench_products_times_only_paths_that_compute_the_product(monkeypatch):
    from helpers import random_decoder

    from minillm.lab.products import format_products, measure_products

    model = accelerate(random_decoder(256))  # every layer's width a multiple of 32: the few-row kernel takes them all
    report = measure_products(model, rows=(1, 3), repeats=1, progress=False)
    paths = report["rows"][1]["float32"]
    assert {"shards, bmm", "few-row kernel, 8 lanes", "Linear (its choice)"} <= set(paths)
    assert all(s > 0 for row in report["rows"] for s in row["float32"].values())
    text = format_products(report)
    assert "few-row kernel" in text
    table = text.splitlines()[1:-1]  # the header and a line per row count line up, whatever the paths' names
    assert len({len(line) for line in table}) == 1, table
    real = kernels.f32_linear
    monkeypatch.setattr(kernels, "f32_linear", lambda *a, **k: real(*a, **k) * 1.01)
    with pytest.raises(ValueError, match="differs from F.linear"):
        measure_products(model, rows=(2,), repeats=1, progress=False)


def test_f32_linear_refuses_gradients_and_runs_under_torch_compile():
    w, x = torch.randn(1, 8, 32), torch.randn(2, 8, requires_grad=True)
    with pytest.raises(RuntimeError, match="no backward"):
        kernels.f32_linear(x, w)
    with torch.no_grad():
        assert torch.equal(kernels.f32_linear(x, w), kernels.f32_linear(x.detach(), w))
    compiled = torch.compile(lambda a: kernels.f32_linear(a, w), fullgraph=True, backend="eager")
    a = torch.randn(3, 8)
    assert torch.equal(compiled(a), kernels.f32_linear(a, w))


@pytest.mark.slow  # torch.compile traces for seconds
def test_a_graph_compiled_before_any_eager_call_runs_the_kernel():
    """In a fresh process nothing has loaded the extension when torch.compile traces the op: tracing loads it, so
    the compiled graph finds the op's CPU kernel when it runs."""
    import subprocess
    import sys

    code = ("import torch; from minillm.fast import kernels\n"
            "f = torch.compile(lambda x, w: kernels.f32_linear(x, w, 0, True), fullgraph=True, backend='inductor')\n"
            "x, w = torch.randn(3, 40), torch.randn(2, 40, 64)\n"
            "y = f(x, w)\n"
            "print(torch.equal(y, kernels.f32_linear(x, w, 0, True)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip().splitlines()[-1:] == ["True"], out.stderr[-2000:]


def test_linear_keeps_forward_ad_and_bias_gradients_on_every_path():
    """Rows that go to oneDNN (here: shards 48 wide, which the kernel does not take) keep a dual's tangent and a
    trainable bias's gradient, as the one-row path does."""
    import torch.autograd.forward_ad as fwAD

    torch.manual_seed(0)
    layer = Linear(torch.randn(96, 16), torch.randn(96), n_shards=2)
    with fwAD.dual_level():
        x = fwAD.make_dual(torch.randn(2, 16), torch.ones(2, 16))
        tangent = fwAD.unpack_dual(layer(x)).tangent
    assert tangent is not None and torch.allclose(tangent, layer.weight.sum(1).expand(2, -1), atol=1e-5)
    layer.bias.requires_grad_(True)
    layer(torch.randn(3, 16)).sum().backward()
    assert torch.equal(layer.bias.grad, torch.full((96,), 3.0))


def test_bench_products_adds_each_layers_bias_and_refuses_other_dtypes(capsys):
    from torch import nn

    from minillm.cli import main
    from minillm.lab.products import measure_products

    model = nn.Sequential(Linear(torch.randn(64, 32), torch.randn(64) * 5))
    report = measure_products(model, rows=(1, 2), repeats=1, progress=False)  # the paths agree with F.linear + bias
    assert len(report["rows"][0]["float32"]) >= 3
    assert main(["bench", "products", "--dtype", "bfloat16"]) == 2
    assert "float32 CPU kernels" in capsys.readouterr().err


@pytest.mark.slow  # a new interpreter under another capability
def test_aten_cpu_capability_avx2_runs_everything_as_on_an_avx2_only_cpu():
    """ATEN_CPU_CAPABILITY=avx2 caps torch, inductor and minillm's kernels alike, and the records say so: the
    way to measure an AVX2-only CPU's paths on a CPU with AVX-512 (docs/decode.md)."""
    import subprocess
    import sys

    code = ("import torch; from minillm.fast import kernels, linear; from minillm.timing import instruction_set\n"
            "x, w = torch.randn(3, 64), torch.randn(1, 64, 32)\n"
            "try:\n    kernels.f32_linear(x, w, 16); wide = 'lanes 16 ran'\n"
            "except RuntimeError as e:\n    wide = str(e).splitlines()[0]\n"
            "print(instruction_set(), linear.FEW_ROWS, wide, sep='|')")
    env = {**__import__("os").environ, "ATEN_CPU_CAPABILITY": "avx2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    isa, few_rows, wide = out.strip().splitlines()[-1].split("|")
    assert isa == "AVX2 by ATEN_CPU_CAPABILITY=avx2"
    assert int(few_rows) == (24 if linear._cpu_vendor() == "AuthenticAMD" else 4)  # Linear's AVX2 limit, not AVX-512's
    assert "ATEN_CPU_CAPABILITY" in wide  # the 16-lane kernel is refused, naming the cap

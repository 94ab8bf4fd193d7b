"""minillm's kernels for a layer's small operations (minillm.fast.kernels: rms_norm, add_rms_norm, silu_mul,
rope_write) against their naive twins, their refusals, and the model and engine running on them."""

import pytest
import torch
from helpers import paged_cache

from minillm.fast import accelerate, kernels
from minillm.fast.layers import FastRMSNorm
from minillm.model import RMSNorm as PlainRMSNorm


def RMSNorm(weight, eps):  # noqa: N802  (the speed layer's norm, built as the library's)
    norm = PlainRMSNorm(weight, eps)
    norm.__class__ = FastRMSNorm
    return norm

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"kernels off: {kernels.why_unavailable()}")


@pytest.mark.parametrize("shape", [(1, 576), (3, 5, 64), (7, 13), (2, 1, 8)])  # 13: a width with a scalar tail
def test_norms_equal_their_naive_twins(shape):
    g = torch.Generator().manual_seed(0)
    x, delta = torch.randn(*shape, generator=g) * 3, torch.randn(*shape, generator=g)
    w = torch.rand(shape[-1], generator=g) + 0.5
    y = kernels.rms_norm(x, w, 1e-5)
    assert y.shape == x.shape
    torch.testing.assert_close(y, kernels.rms_norm_naive(x, w, 1e-5), rtol=2e-6, atol=1e-6)
    h, y = kernels.add_rms_norm(x, delta, w, 1e-5)
    h0, y0 = kernels.add_rms_norm_naive(x, delta, w, 1e-5)
    assert torch.equal(h, h0)  # the residual add is one rounding, as torch's
    torch.testing.assert_close(y, y0, rtol=2e-6, atol=1e-6)


def test_norm_of_a_non_contiguous_input_and_a_zero_row():
    x = torch.randn(8, 64).t()  # (64, 8), not contiguous
    x[3] = 0  # mean square 0: eps keeps the scale finite
    w = torch.rand(8) + 0.5
    y = kernels.rms_norm(x, w, 1e-6)
    torch.testing.assert_close(y, kernels.rms_norm_naive(x, w, 1e-6), rtol=2e-6, atol=1e-6)
    assert torch.equal(y[3], torch.zeros(8))


@pytest.mark.parametrize("width", [3072, 20])  # 20: 10 columns each, a scalar tail
def test_silu_mul_equals_its_naive_twin_over_the_whole_range(width):
    g = torch.Generator().manual_seed(1)
    gate_up = torch.randn(2, 9, width, generator=g) * 4
    gate_up[0, 0, :6] = torch.tensor([-200.0, -90.0, -30.0, 30.0, 90.0, 200.0])  # e^-g under- and overflows
    y = kernels.silu_mul(gate_up)
    assert y.shape == (2, 9, width // 2)
    torch.testing.assert_close(y, kernels.silu_mul_naive(gate_up), rtol=1e-6, atol=1e-6)
    gate_up[0, 1, 0] = float("nan")
    assert torch.isnan(kernels.silu_mul(gate_up)[0, 1, 0])


def pools(num_blocks=10, block_size=4, Hkv=2, D=16):
    return torch.zeros(num_blocks, block_size, Hkv, D), torch.zeros(num_blocks, block_size, Hkv, D)


@pytest.mark.parametrize("H,Hkv,D", [(9, 3, 64), (4, 2, 16), (2, 2, 32)])
def test_rope_write_equals_its_naive_twin_bit_for_bit(H, Hkv, D):
    from minillm.model import rope_tables

    g = torch.Generator().manual_seed(2)
    N = 11
    qkv = torch.randn(N, (H + 2 * Hkv) * D, generator=g)
    cos, sin = rope_tables(D, 64, 10000.0)
    pos = torch.randint(0, 64, (N,), generator=g)
    slots = torch.randperm(10 * 4, generator=g)[:N]
    k1, v1 = torch.full((10, 4, Hkv, D), 7.0), torch.full((10, 4, Hkv, D), 7.0)
    k2, v2 = k1.clone(), v1.clone()
    q1 = kernels.rope_write(qkv, cos[pos], sin[pos], k1, v1, slots)
    q2 = kernels.rope_write_naive(qkv, cos[pos], sin[pos], k2, v2, slots)
    assert q1.shape == (N, H, D)
    assert torch.equal(q1, q2) and torch.equal(k1, k2) and torch.equal(v1, v2)  # the other slots untouched: 7s


def test_rope_write_refuses_what_would_write_outside_the_pool():
    k_pool, v_pool = pools()
    qkv, cs = torch.randn(3, 6 * 16), torch.randn(3, 16)
    with pytest.raises(RuntimeError, match="slot 40 of token 2 is outside the pool's 40 slots"):
        kernels.rope_write(qkv, cs, cs, k_pool, v_pool, torch.tensor([0, 1, 40]))
    with pytest.raises(RuntimeError, match="slot -1"):
        kernels.rope_write(qkv, cs, cs, k_pool, v_pool, torch.tensor([0, -1, 2]))
    with pytest.raises(RuntimeError, match=r"qkv's width 80 must be \(H \+ 2 Hkv\) \* D"):
        kernels.rope_write(torch.randn(3, 5 * 16), cs, cs, k_pool, v_pool, torch.tensor([0, 1, 2]))
    with pytest.raises(RuntimeError, match="cos and sin must be"):
        kernels.rope_write(qkv, cs[:2], cs[:2], k_pool, v_pool, torch.tensor([0, 1, 2]))
    with pytest.raises(RuntimeError, match="float32 CPU tensor"):
        kernels.rope_write(qkv.double(), cs, cs, k_pool, v_pool, torch.tensor([0, 1, 2]))
    assert not k_pool.any() and not v_pool.any()  # nothing written by a refused call


def test_norm_refusals_name_the_problem():
    with pytest.raises(RuntimeError, match=r"weight must be a contiguous \(8,\) float32"):
        kernels.rms_norm(torch.randn(2, 8), torch.randn(7), 1e-5)
    with pytest.raises(RuntimeError, match="delta .* must have x's shape"):
        kernels.add_rms_norm(torch.randn(2, 8), torch.randn(3, 8), torch.randn(8), 1e-5)
    with pytest.raises(RuntimeError, match="even width"):
        kernels.silu_mul(torch.randn(2, 7))


def test_the_model_and_the_paged_cache_agree_with_torchs_operators(monkeypatch):
    """With the layer kernels refused (``fused_ok`` False) the decoder runs torch's operators and the paged cache
    its torch write: the logits and every key and value written agree within float32 rounding."""
    from minillm.fast.paged import FastPagedKVCache as PagedKVCache
    from tests.helpers import random_decoder

    model = accelerate(random_decoder(64))
    tokens = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(3))
    results, calls = [], []
    rope_write = kernels.rope_write
    monkeypatch.setattr(kernels, "rope_write", lambda *a: calls.append(1) or rope_write(*a))
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(kernels, "fused_ok", lambda *tensors: False)
        cache = paged_cache(model.config, num_blocks=8, block_size=4, attention="bucketed")
        cache.add_sequence(0)
        cache.set_rows([0], widths=[9])
        assert cache._fused_ok
        with torch.inference_mode():
            logits = model(tokens, torch.arange(9)[None], cache)
        results.append((logits, cache.k[1], cache.v[1]))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert results[0][1].any()  # the keys were written
    assert len(calls) == model.config.n_layers  # by rope_write in each layer of the first forward, none in the second


def test_rmsnorm_module_falls_back_for_other_dtypes():
    norm = RMSNorm(torch.rand(8) + 0.5, 1e-5)
    x = torch.randn(3, 8).double()
    torch.testing.assert_close(norm.to(torch.float64)(x), PlainRMSNorm.forward(norm, x))


def test_gradients_reach_trainable_weights_behind_a_frozen_embedding():
    """distill_draft's setup (layers trained, embedding frozen): the first layer's input needs no gradient but its
    norms and products do, so the kernels (which do not differentiate) must step aside for torch's operators."""
    from tests.helpers import random_decoder

    model = accelerate(random_decoder(64))
    for p in [*model.layers.parameters(), *model.norm.parameters()]:
        p.requires_grad_(True)
    with torch.enable_grad():
        model(torch.tensor([[1, 2, 3, 4, 5]]), torch.arange(5)).pow(2).mean().backward()
    layer0 = model.layers[0]
    for name, p in [("attn_norm", layer0.attn_norm.weight), ("ffn_norm", layer0.ffn_norm.weight),
                    ("wqkv", layer0.attn.wqkv.weight_shards), ("w_gate_up", layer0.mlp.w_gate_up.weight_shards)]:
        assert p.grad is not None and p.grad.abs().sum() > 0, f"layer 0's {name} got no gradient"


def test_forward_ad_and_torch_func_see_torchs_operators():
    from torch.autograd import forward_ad as fwAD

    norm = RMSNorm(torch.rand(8) + 0.5, 1e-5)
    x, t = torch.randn(3, 8), torch.randn(3, 8)
    with fwAD.dual_level():
        tangent = fwAD.unpack_dual(norm(fwAD.make_dual(x, t))).tangent
    _, expected = torch.func.jvp(lambda x: PlainRMSNorm.forward(norm, x), (x,), (t,))
    assert tangent is not None
    torch.testing.assert_close(tangent, expected)
    torch.testing.assert_close(torch.vmap(norm)(x[:, None]), PlainRMSNorm.forward(norm, x)[:, None], rtol=2e-6, atol=1e-6)
    params = {"weight": norm.weight.detach()}
    g = torch.func.grad(lambda w: torch.func.functional_call(norm, {"weight": w}, (x,)).sum())(params["weight"])
    torch.testing.assert_close(g, torch.func.grad(lambda w: (w * torch.nn.functional.rms_norm(x, (8,), eps=1e-5)).sum())(
        params["weight"]))


def test_rope_write_refuses_pools_it_may_not_write_in_place():
    qkv, cs, slots = torch.randn(2, 6 * 16), torch.randn(2, 16), torch.tensor([0, 1])
    with pytest.raises(RuntimeError, match="at least one KV head"):
        kernels.rope_write(qkv, cs, cs, torch.zeros(2, 4, 0, 16), torch.zeros(2, 4, 0, 16), slots)
    k_pool, v_pool = pools()
    with pytest.raises(RuntimeError, match="must not require grad"):
        kernels.rope_write(qkv, cs, cs, k_pool.requires_grad_(), v_pool, slots)
    with torch.inference_mode():
        k_pool, v_pool = pools()
    with pytest.raises(RuntimeError, match="Inplace update to inference tensor outside InferenceMode"):
        kernels.rope_write(qkv, cs, cs, k_pool, v_pool, slots)
    k_pool, v_pool = pools()
    before = k_pool._version
    kernels.rope_write(qkv, cs, cs, k_pool, v_pool, slots)
    assert k_pool._version > before  # autograd's saved-tensor checks see the write, as index_copy_'s

"""The decoder vs transformers, and each optimized piece vs its naive baseline."""

import copy

import pytest
import torch
from conftest import DEVICES
from helpers import rel_err

from minillm.fast import kernels, linear
from minillm.fast.layers import attention_decode
from minillm.fast.linear import FastLinear as Linear  # the speed layer's, against the library's baseline
from minillm.linear import linear_naive
from minillm.model import apply_rope, attention, attention_naive, rope_tables

PROMPTS = [
    "Hi",
    "The quick brown fox jumps over the lazy dog.",
    "In the beginning God created the heaven and the earth. And the earth was without form, and void; "
    "and darkness was upon the face of the deep.",
]


@pytest.mark.parametrize("n_tokens", [1, 9, 57, 200])
def test_logits_equal_transformers(model, tokenizer, hf_model, play_text, n_tokens):
    ids = tokenizer.encode(play_text[5000:])[:n_tokens]
    tokens = torch.tensor([ids])
    with torch.no_grad():
        ref = hf_model(tokens).logits
    ours = model(tokens, torch.arange(n_tokens))
    assert ours.shape == (1, n_tokens, 49152) and ours.dtype == torch.float32
    assert rel_err(ours, ref) <= 1e-4


@pytest.mark.parametrize("n_shards", [1, 2, 3])
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_sharded_linear_equals_f_linear(n_shards, rows):
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 40, generator=g), torch.randn(96, generator=g)
    x = torch.randn(rows, 1, 40, generator=g)
    layer = Linear(w, b, n_shards=n_shards)
    assert layer.n_shards == n_shards
    assert torch.equal(layer.weight, w)
    torch.testing.assert_close(layer(x), linear_naive(x, layer), rtol=1e-5, atol=1e-5)
    # a few rows go through minillm's kernel over the shards when its columns fit (96 / n_shards a multiple of
    # 32), else one row through the shards (bmm); more rows through oneDNN's packed copy (when torch has it)
    few = kernels.available() and rows <= linear.FEW_ROWS and (96 // n_shards) % kernels.TILE == 0
    assert (layer._packed is not None) == (linear._ONEDNN and rows > 1 and not few)
    idx = torch.tensor([[0, 95, 33, 64]])
    assert torch.equal(layer.rows(idx), w[idx])


@pytest.mark.skipif(not linear._ONEDNN, reason="torch without oneDNN's packed linear")
@pytest.mark.parametrize("shape", [(2, 40), (1, 2, 40), (2, 1, 40), (3, 40)])
def test_onednn_pads_the_rows_it_is_told_to(monkeypatch, shape):
    """A row count in ONEDNN_PADDING reaches oneDNN with zero rows below it (2 -> 4 here); the rows asked for come
    back, equal to the naive product, and no padding leaks into the output's shape."""
    monkeypatch.setattr(linear, "ONEDNN_PADDING", {2: 4})
    seen = []
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda x, *a: seen.append(x.shape) or real(x, *a))
    g = torch.Generator().manual_seed(2)
    layer, x = Linear(torch.randn(96, 40, generator=g), torch.randn(96, generator=g)), torch.randn(*shape, generator=g)
    with torch.inference_mode():
        y = layer.forward_onednn(x)
    assert y.shape == (*shape[:-1], 96)
    assert seen == [(4, 40)] if x.numel() == 80 else seen == [x.shape]
    torch.testing.assert_close(y, linear_naive(x, layer), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("capability, vendor, padding", [("AVX512", "AuthenticAMD", {2: 4}), ("AVX512", "GenuineIntel", {}),
                                                           ("AVX2", "AuthenticAMD", {}), ("AVX512", "", {})])
def test_onednn_padding_follows_the_cpu(monkeypatch, capability, vendor, padding):
    """Padding where it was measured to help: the AMD EPYC with AVX-512, whose oneDNN kernels for two rows are
    slower than its kernels for four (docs/decode.md)."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(linear, "_cpu_vendor", lambda: vendor)
    assert linear._onednn_padding() == padding


@pytest.mark.skipif(not linear._ONEDNN, reason="torch without oneDNN's packed linear")
def test_linear_sends_two_rows_padded_where_told(monkeypatch):
    """Through ``Linear.forward`` with no few-row kernel and the EPYC's padding: one row takes the shards, two reach
    oneDNN as four, three as three."""
    monkeypatch.setattr(linear, "FEW_ROWS", 0)
    monkeypatch.setattr(linear, "ONEDNN_PADDING", {2: 4})
    seen = []
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda x, *a: seen.append(x.shape[0]) or real(x, *a))
    layer = Linear(torch.randn(96, 40), torch.randn(96), n_shards=2)
    with torch.inference_mode():
        for rows in (1, 2, 3):
            x = torch.randn(rows, 40)
            torch.testing.assert_close(layer(x), linear_naive(x, layer), rtol=1e-5, atol=1e-5)
    assert seen == [4, 3]


def test_linear_packed_copy_follows_the_weight():
    g = torch.Generator().manual_seed(1)
    layer, x = Linear(torch.randn(24, 16, generator=g)), torch.randn(3, 16, generator=g)
    layer(x)
    with torch.no_grad():
        layer.weight_shards.mul_(2)  # in place: the packed copy must not go stale
    torch.testing.assert_close(layer(x), x @ layer.weight.t(), rtol=1e-5, atol=1e-5)
    layer.weight_shards.data = torch.randn(1, 16, 24, generator=g)  # replaced
    torch.testing.assert_close(layer(x), x @ layer.weight.t(), rtol=1e-5, atol=1e-5)
    for _ in range(3):  # replaced twice between forwards: the allocator may hand back the first address
        layer.weight_shards.data = torch.randn(1, 16, 24, generator=g)
        layer.weight_shards.data = torch.randn(1, 16, 24, generator=g)
        torch.testing.assert_close(layer(x), x @ layer.weight.t(), rtol=1e-5, atol=1e-5)
    twin = copy.deepcopy(layer)  # the opaque packed tensor is not copied, it is rebuilt
    with torch.no_grad():
        twin.weight_shards.zero_()
    assert torch.count_nonzero(twin(x)) == 0 and torch.count_nonzero(layer(x)) > 0


def test_linear_other_dtypes_and_gradients_use_the_shards():
    g = torch.Generator().manual_seed(2)
    layer, x = Linear(torch.randn(8, 4, generator=g)), torch.randn(2, 4, generator=g)
    layer.weight_shards.requires_grad_(True)
    layer(x).sum().backward()  # through the shards: the packed kernel has no backward
    torch.testing.assert_close(layer.weight_shards.grad[0], x.sum(0)[:, None].expand(4, 8))
    layer.weight_shards.requires_grad_(False)
    layer64 = Linear(layer.weight.double())
    torch.testing.assert_close(layer64(x.double()), x.double() @ layer.weight.double().t())
    assert layer64._packed is None


def test_linear_falls_back_to_one_shard():
    assert Linear(torch.zeros(7, 4), n_shards=2).n_shards == 1


@pytest.mark.parametrize("T,S", [(1, 1), (1, 17), (5, 5), (4, 12)])
def test_sdpa_attention_equals_naive(T, S):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 9, T, 64, generator=g)
    k, v = torch.randn(2, 3, S, 64, generator=g), torch.randn(2, 3, S, 64, generator=g)
    q_pos, k_pos = torch.arange(S - T, S), torch.arange(S)
    mask = k_pos[None, :] <= q_pos[:, None]
    torch.testing.assert_close(attention(q, k, v, mask), attention_naive(q, k, v, mask), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("H,Hkv,S", [(9, 3, 1), (9, 3, 77), (4, 4, 30), (8, 1, 5)])
def test_decode_attention_equals_naive(H, Hkv, S):
    """The one-query path taken under torch.compile, eager and compiled, against the naive baseline
    (GQA groups of 3, plain multi-head, one shared KV head)."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, H, 1, 64, generator=g)
    k, v = torch.randn(2, Hkv, S, 64, generator=g), torch.randn(2, Hkv, S, 64, generator=g)
    ref = attention_naive(q, k, v, None)
    torch.testing.assert_close(attention_decode(q, k, v), ref, rtol=1e-5, atol=1e-5)
    if S == 77:  # compiling takes seconds: one case
        compiled = torch.compile(attention_decode, fullgraph=True, dynamic=False)
        torch.testing.assert_close(compiled(q, k, v), ref, rtol=1e-5, atol=1e-5)
    # bfloat16 inputs: no worse than SDPA's own rounding against the float32 result
    q16, k16, v16 = (t.bfloat16() for t in (q, k, v))
    err = (attention_decode(q16, k16, v16).float() - ref).abs().max()
    sdpa_err = (attention(q16, k16, v16, None).float() - ref).abs().max()
    assert err <= 2 * sdpa_err + 1e-3


def test_rope_rotates_pairs_by_position_angle():
    cos, sin = rope_tables(head_dim=4, max_seq_len=8, base=10000.0)
    x = torch.tensor([1.0, 0.0, 0.0, 0.0]).view(1, 1, 1, 4)
    # dimension 0 pairs with dimension 2 (rotate-half); its frequency is base^0 = 1 rad per position
    y = apply_rope(x, cos[3:4], sin[3:4])
    torch.testing.assert_close(y.flatten(), torch.tensor([torch.cos(torch.tensor(3.0)), 0.0,
                                                          torch.sin(torch.tensor(3.0)), 0.0]))
    # rotation preserves the norm, and relative angles only depend on the offset
    q = torch.randn(1, 1, 1, 4)
    dots = [(apply_rope(q, cos[p:p + 1], sin[p:p + 1]) * apply_rope(q, cos[p + 2:p + 3], sin[p + 2:p + 3])).sum()
            for p in range(4)]
    torch.testing.assert_close(torch.stack(dots), dots[0].expand(4))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_runs_on_the_same_path(dtype, model_path, model):
    from minillm import load_model

    model16, tok = load_model(model_path, dtype=dtype)
    ids = tok.encode(PROMPTS[1])
    ref = model(torch.tensor([ids]), torch.arange(len(ids)))
    out = model16(torch.tensor([ids]), torch.arange(len(ids)))
    assert model16.output.weight_shards.dtype == dtype and model16.rope_cos.dtype == torch.float32
    plain16, _ = load_model(model_path, dtype=dtype, fast=False)
    assert plain16.output.weight.dtype == dtype
    assert torch.equal(plain16(torch.tensor([ids]), torch.arange(len(ids)))[0, -1].argmax(), ref[0, -1].argmax())
    assert out.dtype == torch.float32
    assert rel_err(out, ref) < 0.05
    assert torch.equal(out[0, -1].argmax(), ref[0, -1].argmax())


@pytest.mark.parametrize("device", DEVICES)
def test_devices(device, model_path, model):
    from minillm import load_model

    m, tok = load_model(model_path, device=device) if device != "cpu" else (model, None)
    ids = torch.tensor([[1, 2, 3, 4]], device=device)
    out = m(ids, torch.arange(4, device=device))
    assert out.device.type == device and torch.isfinite(out).all()


def test_position_past_context_raises(model):
    with pytest.raises(ValueError, match="input_pos: position 8192 is past the context length"):
        model(torch.tensor([[1]]), torch.tensor([8192]))


def test_bad_forward_inputs(model):
    from minillm import KVCache

    with pytest.raises(ValueError, match=r"tokens: ids must be in \[0, 49152\)"):
        model(torch.tensor([[49152]]), torch.tensor([0]))
    with pytest.raises(ValueError, match="input_pos: must start at 0 without a cache"):
        model(torch.tensor([[5]]), torch.tensor([3]))
    with pytest.raises(ValueError, match="input_pos: positions must be consecutive"):
        model(torch.tensor([[5, 6, 7]]), torch.tensor([0, 2, 5]), KVCache(model.config, 1, 16))


@pytest.mark.parametrize("shape", [(1, 1, 576), (3, 5, 64)])
def test_rmsnorm_equals_its_naive_twin(shape):
    from minillm.fast.layers import FastRMSNorm
    from minillm.model import RMSNorm

    g = torch.Generator().manual_seed(0)
    plain = RMSNorm(torch.randn(shape[-1], generator=g), 1e-5)
    norm = copy.deepcopy(plain)
    norm.__class__ = FastRMSNorm
    x = torch.randn(*shape, generator=g) * 3
    # minillm's kernel sums the squares in another order than torch: float32 rounding apart
    torch.testing.assert_close(norm(x), plain(x), rtol=2e-6, atol=1e-6)
    delta = torch.randn(*shape, generator=g)
    h, y = norm.add_forward(x, delta)
    assert torch.equal(h, x + delta)
    torch.testing.assert_close(y, plain(x + delta), rtol=2e-6, atol=1e-6)
    half = x.bfloat16()  # other dtypes take the library's path itself
    assert torch.equal(norm.to(torch.bfloat16)(half), plain.to(torch.bfloat16)(half))

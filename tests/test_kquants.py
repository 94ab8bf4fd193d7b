"""llama.cpp's k-quants in minillm: Q4_K / Q6_K / Q5_0 blocks read bit for bit as the gguf package reads
them, our quantizers against their per-block loops, the gguf package's Q5_0 and llama.cpp itself,
the Q4_K_M recipe, and the Q4_K_M writer round-tripping a tiny GGUF (and the real model, slow)."""

import importlib.util

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, quants
from helpers import rel_err, tiny_llama_weights, write_tiny_gguf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minillm.formats import gguf_blocks, kquants
from minillm.formats.gguf_quant import (
    quantize_q4_1,
    quantize_q5_0,
    tensor_types,
    write_gguf,
)

HAS_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None
needs_llama_cpp = pytest.mark.skipif(not HAS_LLAMA_CPP, reason="llama-cpp-python (optional) is not installed")
# rows that 256 divides, so the tiny model's tensors really are k-quants (SmolLM2's 576 fall back)
TINY_K = {"n_layers": 2, "dim": 256, "n_heads": 4, "n_kv_heads": 2, "head_dim": 64, "ffn_dim": 512, "vocab": 300,
          "ctx": 128}


def f16(x) -> list[int]:
    return list(np.array([x], dtype=np.float16).view(np.uint8))


def gguf_dequant(raw, qtype, n):
    return torch.from_numpy(quants.dequantize(np.asarray(raw, dtype=np.uint8).reshape(1, -1), qtype)).reshape(n)


# ------------------------------------------------------------------------------ dequantization


def test_hand_built_q4_k_block():
    # 6-bit scales and mins with high bits set (>= 16) in both halves, to exercise the 12-byte packing
    sc = [1, 17, 33, 63, 2, 18, 40, 63]
    m = [0, 5, 16, 63, 31, 32, 48, 1]
    packed = [0] * 12
    for j in range(8):
        if j < 4:
            packed[j], packed[j + 4] = sc[j], m[j]
        else:  # low nibbles in bytes 8..11, the top 2 bits in the top of bytes 0..7
            packed[j + 4] = (sc[j] & 15) | ((m[j] & 15) << 4)
            packed[j - 4] |= (sc[j] >> 4) << 6
            packed[j] |= (m[j] >> 4) << 6
    codes = np.arange(256) % 16  # weight i has code i % 16
    qs = [0] * 128
    for j in range(8):  # sub-block j: group j // 2 of 32 bytes, low nibble for even j
        for i in range(32):
            qs[32 * (j // 2) + i] |= int(codes[32 * j + i]) << (4 * (j % 2))
    block = np.array(f16(0.5) + f16(0.25) + packed + qs, dtype=np.uint8)
    assert block.size == 144
    expected = [np.float32(0.5) * sc[i // 32] * codes[i] - np.float32(0.25) * m[i // 32] for i in range(256)]
    out = gguf_blocks.dequantize(block, Q.Q4_K, (256,))
    assert out.tolist() == [float(np.float32(e)) for e in expected]
    assert torch.equal(out, gguf_dequant(block, Q.Q4_K, 256))


def test_hand_built_q6_k_block():
    codes = (np.arange(256) * 7) % 64  # 6-bit codes, every value reached
    scales = np.array([-128, -3, -1, 0, 1, 2, 5, 9, 17, 33, 64, 100, 127, -64, -20, 7], dtype=np.int8)
    ql, qh = [0] * 128, [0] * 64
    for i in range(256):  # weight i = 128 h + 32 k + l: low 4 bits in ql, high 2 bits in qh
        h, k, l = i // 128, (i % 128) // 32, i % 32
        ql[64 * h + l + 32 * (k % 2)] |= int(codes[i] & 15) << (4 * (k // 2))
        qh[32 * h + l] |= int(codes[i] >> 4) << (2 * k)
    block = np.array(ql + qh + list(scales.view(np.uint8)) + f16(0.125), dtype=np.uint8)
    assert block.size == 210
    out = gguf_blocks.dequantize(block, Q.Q6_K, (256,))
    assert out.tolist() == [0.125 * int(scales[i // 16]) * (int(codes[i]) - 32) for i in range(256)]
    assert torch.equal(out, gguf_dequant(block, Q.Q6_K, 256))


def test_hand_built_q5_0_block():
    codes = np.arange(32)[::-1].copy()  # 31 .. 0: fifth bit set for weights 0..15
    qh = sum(int(codes[j] >> 4) << j for j in range(32))
    qs = [int(codes[j] & 15) | (int(codes[j + 16] & 15) << 4) for j in range(16)]
    block = np.array(f16(-0.75) + list(np.array([qh], "<u4").view(np.uint8)) + qs, dtype=np.uint8)
    out = gguf_blocks.dequantize(block, Q.Q5_0, (32,))
    assert out.tolist() == [-0.75 * (int(c) - 16) for c in codes]
    assert torch.equal(out, gguf_dequant(block, Q.Q5_0, 32))


def random_blocks(qtype, n, seed=0):
    """n random blocks with finite float16 scales (random bytes could be inf/NaN, which compare unequal)."""
    rng = np.random.default_rng(seed)
    weights, nbytes = gguf_blocks.BLOCK_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n, nbytes), dtype=np.uint8)
    f16_at = {Q.Q5_0: [0], Q.Q4_K: [0, 2], Q.Q6_K: [208]}[qtype]
    for at in f16_at:
        raw[:, at:at + 2] = rng.uniform(-3, 3, size=(n, 1)).astype(np.float16).view(np.uint8)
    return raw, weights


@pytest.mark.parametrize("qtype", [Q.Q5_0, Q.Q4_K, Q.Q6_K])
def test_random_blocks_match_gguf(qtype):
    raw, weights = random_blocks(qtype, 64)
    ours = gguf_blocks.dequantize(raw.reshape(4, -1), qtype, (4, 16 * weights))
    ref = torch.from_numpy(quants.dequantize(raw.reshape(4, -1), qtype))
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("qtype, naive, fast", [
    (Q.Q4_K, gguf_blocks.dequantize_q4_k_naive, gguf_blocks.dequantize_q4_k),
    (Q.Q6_K, gguf_blocks.dequantize_q6_k_naive, gguf_blocks.dequantize_q6_k)])
def test_per_block_loop_dequantizers_agree(qtype, naive, fast):
    raw, _ = random_blocks(qtype, 16, seed=1)
    assert torch.equal(naive(raw), fast(raw))


# -------------------------------------------------------------------------------- quantization


def awkward_weights(seed=0) -> torch.Tensor:
    """4 super-blocks of 256 with the cases the searches branch on: an all-zero sub-block, a constant
    one, an all-positive one, tiny magnitudes beside large ones, one outlier, and plain Gaussians."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 256, generator=g)
    x[0, :32] = 0.0
    x[0, 32:64] = 0.3
    x[1, :32] = torch.rand(32, generator=g) + 0.5
    x[1, 64:96] *= 1e-4
    x[2, 7] = 40.0
    x[3, 200:216] = 0.0  # an all-zero Q6_K sub-block of 16
    return x


@pytest.mark.parametrize("fast, naive", [(kquants.quantize_q4_k, kquants.quantize_q4_k_naive),
                                         (kquants.quantize_q6_k, kquants.quantize_q6_k_naive)])
def test_vectorized_quantizers_equal_their_per_block_loops(fast, naive):
    x = awkward_weights()
    assert np.array_equal(fast(x), naive(x))


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), scale=st.sampled_from([1e-3, 0.05, 1.0, 300.0]),
       shift=st.sampled_from([0.0, 0.5, -2.0]))
def test_quantizers_equal_their_loops_on_random_super_blocks(seed, scale, shift):
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(seed)) * scale + shift * scale
    assert np.array_equal(kquants.quantize_q4_k(x), kquants.quantize_q4_k_naive(x))
    assert np.array_equal(kquants.quantize_q6_k(x), kquants.quantize_q6_k_naive(x))


def test_all_zero_super_blocks():
    x = torch.zeros(2, 256)
    assert not kquants.quantize_q6_k(x).any()  # llama.cpp stores an all-zero Q6_K block as zero bytes
    for quantize, qtype in ((kquants.quantize_q4_k, Q.Q4_K), (kquants.quantize_q6_k, Q.Q6_K)):
        assert not gguf_blocks.dequantize(quantize(x), qtype, (2, 256)).any()


def test_q5_0_equals_the_gguf_package():
    x = awkward_weights(1).reshape(8, 128).numpy()
    assert np.array_equal(quantize_q5_0(torch.from_numpy(x)), quants.quantize(x, Q.Q5_0))
    w = np.random.default_rng(2).standard_normal((64, 576)).astype(np.float32)
    assert np.array_equal(quantize_q5_0(torch.from_numpy(w)), quants.quantize(w, Q.Q5_0))


def test_round_trip_errors_order_as_their_bits():
    x = torch.randn(64, 512, generator=torch.Generator().manual_seed(3))
    err = {name: rel_err(gguf_blocks.dequantize(q(x), t, tuple(x.shape)), x) for name, q, t in (
        ("q4_1", quantize_q4_1, Q.Q4_1), ("q4_k", kquants.quantize_q4_k, Q.Q4_K),
        ("q5_0", quantize_q5_0, Q.Q5_0), ("q6_k", kquants.quantize_q6_k, Q.Q6_K))}
    # Q4_K (4.5 bits/weight) beats Q4_1 (5.0): its scales are searched and its mins need not be the min
    assert err["q6_k"] < err["q5_0"] < err["q4_k"] < err["q4_1"] < 0.11
    assert err["q6_k"] < 0.025


def test_the_search_never_does_worse_than_min_max_rounding():
    x = torch.randn(512, 32, generator=torch.Generator().manual_seed(4))
    w = kquants._sqrt(kquants._sum(x * x) / 32)[:, None] + x.abs()
    scale, the_min, L = kquants.make_qkx2_quants(x, w, 15, -1.0, 0.1, 20)
    lo, hi = x.amin(1, keepdim=True).clamp(max=0), x.amax(1, keepdim=True)
    step = (hi - lo) / 15
    rtn = ((x - lo) / step).round().clamp(0, 15) * step + lo
    searched = scale[:, None] * L.float() - the_min[:, None]
    err_search, err_rtn = (w * (searched - x) ** 2).sum(1), (w * (rtn - x) ** 2).sum(1)
    assert (err_search <= err_rtn * (1 + 1e-5)).all()
    assert err_search.sum() < 0.9 * err_rtn.sum()  # and it finds something better on the whole


def test_rows_that_256_does_not_divide_are_refused():
    with pytest.raises(ValueError, match="not a multiple of the block size 256"):
        kquants.quantize_q4_k(torch.zeros(2, 576))


# ----------------------------------------------------------------------------------- the recipe


def smollm2_tensors(n_layers=30):
    shapes = {"attn_q": (576, 576), "attn_k": (192, 576), "attn_v": (192, 576), "attn_output": (576, 576),
              "ffn_gate": (1536, 576), "ffn_up": (1536, 576), "ffn_down": (576, 1536)}
    tensors = [("token_embd.weight", (49152, 576)), ("output_norm.weight", (576,))]
    for i in range(n_layers):
        tensors += [(f"blk.{i}.attn_norm.weight", (576,)), (f"blk.{i}.ffn_norm.weight", (576,))]
        tensors += [(f"blk.{i}.{k}.weight", s) for k, s in shapes.items()]
    return tensors


def test_use_more_bits_layers():
    assert [i for i in range(32) if kquants.use_more_bits(i, 32)] == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27,
                                                                       28, 29, 30, 31]
    assert [i for i in range(30) if kquants.use_more_bits(i, 30)] == [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27,
                                                                       28, 29]


def test_q4_k_m_recipe_on_smollm2_shapes():
    types = kquants.q4_k_m_types(smollm2_tensors(), 30)
    more = {0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29}
    assert types["token_embd.weight"] == Q.Q8_0  # tied output layer: Q6_K wanted, 576 % 256 -> Q8_0
    assert types["output_norm.weight"] is None
    for i in range(30):
        assert types[f"blk.{i}.ffn_down.weight"] == (Q.Q6_K if i in more else Q.Q4_K)  # 1536 = 6 x 256
        assert types[f"blk.{i}.attn_v.weight"] == (Q.Q8_0 if i in more else Q.Q5_0)  # Q6_K / Q4_K fall back
        for k in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
            assert types[f"blk.{i}.{k}.weight"] == Q.Q5_0
    counts = {t: sum(v == t for v in types.values()) for t in (Q.Q4_K, Q.Q6_K, Q.Q5_0, Q.Q8_0)}
    assert counts == {Q.Q4_K: 16, Q.Q6_K: 14, Q.Q5_0: 166, Q.Q8_0: 15}


def test_q4_k_m_recipe_when_256_divides_and_the_output_is_untied():
    tensors = [("token_embd.weight", (1000, 1024)), ("output.weight", (1000, 1024))]
    tensors += [(f"blk.{i}.{k}.weight", (1024, 1024)) for i in range(32) for k in ("attn_q", "attn_v", "ffn_down")]
    types = kquants.q4_k_m_types(tensors, 32)
    assert types["output.weight"] == Q.Q6_K and types["token_embd.weight"] == Q.Q4_K
    assert sum(types[f"blk.{i}.attn_v.weight"] == Q.Q6_K for i in range(32)) == 16
    assert all(types[f"blk.{i}.attn_q.weight"] == Q.Q4_K for i in range(32))


def test_q4_k_m_recipe_falls_back_as_llama_cpp_where_32_does_not_divide():
    # rows of 48: no 32-weight type holds them, so llama.cpp's last resort, F16 (Q4_K -> Q5_0 -> F16,
    # Q6_K -> Q8_0 -> F16); rows of 96 take the 32-weight fallbacks
    tensors = [("token_embd.weight", (300, 48)), ("output_norm.weight", (48,))]
    tensors += [(f"blk.{i}.{k}.weight", s) for i in range(2)
                for k, s in (("attn_q", (48, 48)), ("attn_v", (24, 48)), ("ffn_down", (48, 96)))]
    types = kquants.q4_k_m_types(tensors, 2)
    assert types["token_embd.weight"] == Q.F16  # the tied output layer: Q8_0, which llama.cpp cannot fall back from
    assert types["output_norm.weight"] is None
    assert types["blk.0.attn_q.weight"] == types["blk.1.attn_q.weight"] == Q.F16  # Q4_K -> Q5_0 -> F16
    assert types["blk.1.attn_v.weight"] == Q.F16  # Q6_K -> Q8_0 -> F16
    assert types["blk.0.ffn_down.weight"] == Q.Q5_0 and types["blk.1.ffn_down.weight"] == Q.Q8_0  # 96 = 3 x 32


def test_quantize_command_writes_q4_k_m_of_a_model_48_wide(tmp_path):
    import minillm
    from minillm.cli import main

    cfg = {"n_layers": 2, "dim": 48, "n_heads": 4, "n_kv_heads": 2, "head_dim": 12, "ffn_dim": 96, "vocab": 300,
           "ctx": 128}
    src, out = tmp_path / "tiny48-f32.gguf", tmp_path / "tiny48-q4_k_m.gguf"
    weights = write_tiny_gguf(src, tiny_llama_weights(cfg=cfg), cfg=cfg)
    assert main(["quantize", "--quant", "q4_k_m", "--model", str(src), "--out", str(out), "--json"]) == 0
    got = {t.name: t.tensor_type for t in GGUFReader(out).tensors}
    assert got["token_embd.weight"] == got["blk.0.attn_q.weight"] == got["blk.1.ffn_gate.weight"] == Q.F16
    assert got["blk.0.ffn_down.weight"] == Q.Q5_0 and got["blk.1.ffn_down.weight"] == Q.Q8_0  # rows of 96
    assert got["blk.0.attn_norm.weight"] == Q.F32
    emb = next(t for t in GGUFReader(out).tensors if t.name == "token_embd.weight")
    assert np.array_equal(np.asarray(emb.data), weights["token_embd.weight"].astype(np.float16))
    tokens, pos = torch.arange(1, 33)[None], torch.arange(32)
    logits = [minillm.load_model(p)[0](tokens, pos) for p in (src, out)]
    assert 0 < rel_err(logits[1], logits[0]) < 0.1  # only the ffn_down tensors are 32-weight blocks


# ------------------------------------------------------------------------------------ the writer


@pytest.fixture(scope="module")
def tiny_k(tmp_path_factory):
    folder = tmp_path_factory.mktemp("kquants")
    src = folder / "tiny-f32.gguf"
    weights = write_tiny_gguf(src, tiny_llama_weights(cfg=TINY_K), cfg=TINY_K)
    return src, weights, write_gguf(src, folder / "tiny-q4_k_m.gguf", "q4_k_m")


def test_q4_k_m_writer_round_trips_a_tiny_gguf(tiny_k):
    import minillm

    src, weights, out = tiny_k
    a, b = GGUFReader(src), GGUFReader(out)
    assert [(t.name, t.shape.tolist()) for t in a.tensors] == [(t.name, t.shape.tolist()) for t in b.tensors]
    got = {t.name: t.tensor_type for t in b.tensors}
    assert got["token_embd.weight"] == Q.Q6_K  # the tied output layer
    assert got["blk.0.ffn_down.weight"] == Q.Q4_K and got["blk.1.ffn_down.weight"] == Q.Q6_K
    assert got["blk.0.attn_q.weight"] == Q.Q4_K and got["blk.1.attn_v.weight"] == Q.Q6_K
    assert got["blk.0.attn_norm.weight"] == Q.F32
    assert b.fields["tokenizer.ggml.tokens"].contents() == a.fields["tokenizer.ggml.tokens"].contents()
    assert "general.file_type" not in a.fields and b.fields["general.file_type"].contents() == 15  # MOSTLY_Q4_K_M
    for t in b.tensors:  # what was written is our quantizer's output on the source weights
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))
        w = gguf_blocks.dequantize(t.data, t.tensor_type, shape)
        if t.name.endswith(("attn_q.weight", "attn_k.weight")):
            continue  # stored permuted (llama.cpp's row order)
        assert rel_err(w, torch.from_numpy(weights[t.name])) < (0.02 if t.tensor_type == Q.Q6_K else 0.1), t.name
    # minillm loads it, and its logits are closer to the float model's than those of Q4_1 (5 bits per
    # weight); this random model amplifies weight errors (Q8_0 still gives 4%)
    tokens, pos = torch.arange(1, 33)[None], torch.arange(32)
    q4_1 = write_gguf(src, out.with_name("q4_1.gguf"), "q4_1")
    logits = {p.name: minillm.load_model(p)[0](tokens, pos) for p in (src, out, q4_1)}
    assert rel_err(logits[out.name], logits[src.name]) < 0.8 * rel_err(logits["q4_1.gguf"], logits[src.name])


def test_quantize_command_writes_q4_k_m(tiny_k, tmp_path):
    from minillm.cli import main

    src, _, ours = tiny_k
    out = tmp_path / "cli.gguf"
    assert main(["quantize", "--quant", "q4_k_m", "--model", str(src), "--out", str(out), "--json"]) == 0
    assert out.read_bytes() == ours.read_bytes()


def test_writer_refuses_an_unknown_type(tiny_k, tmp_path):
    with pytest.raises(ValueError, match="Q4_K_M"):
        write_gguf(tiny_k[0], tmp_path / "x.gguf", "q3_k_m")


@needs_llama_cpp
def test_tiny_q4_k_m_has_llama_cpps_bytes(tiny_k, tmp_path):
    from minillm.lab.kquants import compare_blocks, llamacpp_quantize

    src, _, ours = tiny_k
    theirs = llamacpp_quantize(src, tmp_path / "tiny-llamacpp.gguf")
    report = compare_blocks(ours, theirs)
    assert report["same_names"] and report["same_shapes"] and not report["type_mismatches"]
    assert set(report["bytes"]) >= {"Q4_K", "Q6_K"}
    assert sum(report["bytes_differing"].values()) == 0, report


# -------------------------------------------------------------------------- the real model (slow)


@pytest.fixture(scope="module")
def smollm2_q4_k_m(model_path, tmp_path_factory):
    return write_gguf(model_path, tmp_path_factory.mktemp("q4km") / "smollm2-q4_k_m.gguf", "q4_k_m")


def test_real_model_q4_k_m_file(model_path, smollm2_q4_k_m, reader):
    import minillm

    ours = GGUFReader(smollm2_q4_k_m)
    assert [(t.name, t.shape.tolist()) for t in ours.tensors] == [(t.name, t.shape.tolist()) for t in reader.tensors]
    assert {t.name: t.tensor_type for t in ours.tensors} == {
        n: (q if q is not None else Q.F32) for n, q in tensor_types(reader, "Q4_K_M").items()}
    assert ours.fields["general.file_type"].contents() == 15  # LLAMA_FTYPE_MOSTLY_Q4_K_M (the source says 3, Q4_1)
    for t in ours.tensors:  # every tensor, Q4_K / Q6_K / Q5_0 / Q8_0, read as the gguf package reads it
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))
        ref = torch.from_numpy(quants.dequantize(t.data, t.tensor_type).astype(np.float32)).reshape(shape)
        assert torch.equal(gguf_blocks.dequantize(t.data, t.tensor_type, shape), ref), t.name
    model, tokenizer = minillm.load_model(smollm2_q4_k_m)
    out = minillm.generate_cached(model, tokenizer.encode("The capital of France is"),
                                  minillm.SamplingParams(max_new_tokens=4), tokenizer=tokenizer)
    assert "Paris" in out.text


@needs_llama_cpp
def test_llama_cpp_loads_our_q4_k_m_and_it_equals_its_own(model_path, smollm2_q4_k_m, tmp_path):
    import llama_cpp

    from minillm.lab.kquants import compare_blocks, llamacpp_quantize

    theirs = llamacpp_quantize(model_path, tmp_path / "llamacpp-q4_k_m.gguf")
    report = compare_blocks(smollm2_q4_k_m, theirs)
    assert not report["type_mismatches"] and sum(report["bytes_differing"].values()) == 0, report

    def greedy(path):
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=128, n_threads=1, verbose=False, seed=0)
        return llm("The capital of France is", max_tokens=8, temperature=0.0)["choices"][0]["text"]

    text = greedy(smollm2_q4_k_m)
    assert "Paris" in text and text == greedy(theirs)

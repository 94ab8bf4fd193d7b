"""minillm's Q8_0 / Q4_0 / Q4_1 / F16 dequantization vs the gguf package, bit for bit (the k-quants and Q5_0: test_kquants.py)."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants

from minillm.formats import gguf_blocks


def test_every_tensor_of_the_embedded_model_matches_gguf(reader):
    seen = set()
    for t in reader.tensors:
        shape = tuple(int(s) for s in reversed(t.shape))
        ours = gguf_blocks.dequantize(t.data, t.tensor_type, shape)
        ref = torch.from_numpy(quants.dequantize(t.data, t.tensor_type).astype(np.float32)).reshape(shape)
        assert torch.equal(ours, ref), t.name
        seen.add(t.tensor_type)
    assert seen == {Q.F32, Q.Q4_1, Q.Q8_0}  # the shipped file: norms F32, layers Q4_1, embedding Q8_0


def f16_bytes(x):
    return list(np.array([x], dtype=np.float16).view(np.uint8))


def test_hand_built_q8_0_block():
    qs = np.arange(-16, 16, dtype=np.int8)
    block = np.array(f16_bytes(0.5) + list(qs.view(np.uint8)), dtype=np.uint8)[None]
    out = gguf_blocks.dequantize(block, Q.Q8_0, (32,))
    assert out.tolist() == [0.5 * q for q in range(-16, 16)]


def test_hand_built_q4_0_block():
    # byte j holds weight j in its low nibble and weight j + 16 in its high nibble
    lo, hi = np.arange(16), 15 - np.arange(16)
    block = np.array(f16_bytes(2.0) + list((lo | (hi << 4)).astype(np.uint8)), dtype=np.uint8)[None]
    out = gguf_blocks.dequantize(block, Q.Q4_0, (32,))
    expected = [2.0 * (q - 8) for q in lo] + [2.0 * (q - 8) for q in hi]
    assert out.tolist() == expected


def test_hand_built_q4_1_block():
    lo, hi = np.arange(16), np.full(16, 3)
    block = np.array(f16_bytes(0.25) + f16_bytes(-1.0) + list((lo | (hi << 4)).astype(np.uint8)), dtype=np.uint8)[None]
    out = gguf_blocks.dequantize(block, Q.Q4_1, (32,))
    assert out.tolist() == [0.25 * q - 1.0 for q in lo] + [0.25 * 3 - 1.0] * 16


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_random_blocks_match_gguf(qtype):
    rng = np.random.default_rng(0)
    rows, cols = 8, 64
    raw = rng.integers(0, 256, size=(rows, cols // 32 * gguf_blocks.BLOCK_BYTES[qtype]), dtype=np.uint8)
    n_scales = 2 if qtype == Q.Q4_1 else 1
    blocks = raw.reshape(-1, gguf_blocks.BLOCK_BYTES[qtype])
    # finite float16 scales (random bytes could be inf/NaN, which compare unequal)
    blocks[:, : 2 * n_scales] = rng.uniform(-2, 2, size=(len(blocks), n_scales)).astype(np.float16).view(np.uint8)
    ours = gguf_blocks.dequantize(raw, qtype, (rows, cols))
    ref = torch.from_numpy(quants.dequantize(raw, qtype)).reshape(rows, cols)
    assert torch.equal(ours, ref)


def test_quantized_weights_round_trip_through_gguf_quantizer():
    w = np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32)
    for qtype in (Q.Q8_0, Q.Q4_0, Q.Q4_1):
        data = quants.quantize(w, qtype)
        ours = gguf_blocks.dequantize(data, qtype, w.shape)
        assert torch.equal(ours, torch.from_numpy(quants.dequantize(data, qtype)))
        assert (ours - torch.from_numpy(w)).abs().max() < (0.02 if qtype == Q.Q8_0 else 0.5)


def test_f16_tensor():
    x = np.array([[1.5, -2.25], [65504.0, 6e-8]], dtype=np.float16)
    assert gguf_blocks.dequantize(x, Q.F16, (2, 2)).tolist() == x.astype(np.float32).tolist()


def test_size_mismatch_and_unsupported_type_raise():
    with pytest.raises(ValueError, match="needs"):
        gguf_blocks.dequantize(np.zeros((1, 20), np.uint8), Q.Q4_1, (64,))
    with pytest.raises(ValueError, match="Q8_1 is not supported"):
        gguf_blocks.dequantize(np.zeros((1, 36), np.uint8), Q.Q8_1, (32,))

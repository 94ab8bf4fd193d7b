"""Exercise 14: the numbers a quantized file stores. RTN's per-row scale and zero point (the affine
grid every method starts from; Jacob et al. 2018, Frantar et al. 2023 Sec. 2), Q4_K's eight 6-bit
sub-block scales and mins packed into 12 bytes (llama.cpp's ``get_scale_min_k4`` layout), and the
variable-bitrate choice: one option per layer, the least total error within a budget of bits (a
multiple-choice knapsack, as ExLlamaV2's optimizer solves it).

References: ``minillm.quant.rtn.find_params`` (asymmetric, per row), ``minillm.formats.kquants.
pack_q4_k_scales`` and ``minillm.quant.bitrate.optimize_naive`` (every combination).
"""

from __future__ import annotations


import torch

from ..formats.kquants import pack_q4_k_scales
from ..quant.bitrate import optimize_naive
from ..quant.rtn import QuantConfig, find_params
from .checker import Case, Exercise, Failure, describe, first_match, kind, same_tensor, tensor_problem

# ---------------------------------------------------------------------------------------------
# rtn_scale_zero


def reference_rtn(w, bits):
    scale, zero = find_params(w, QuantConfig(bits=bits, group_size=-1))
    return scale, zero.long()


def _rtn(w, bits, *, include_zero=True, fp16=True, levels="maxq", round_zero=True, sign=1):
    w = w.float()
    lo, hi = w.min(1).values, w.max(1).values
    if include_zero:
        lo, hi = lo.clamp(max=0), hi.clamp(min=0)
    empty = (lo == 0) & (hi == 0)
    lo, hi = torch.where(empty, -1.0, lo), torch.where(empty, 1.0, hi)
    maxq = (1 << bits) - 1
    scale = (hi - lo) / (maxq if levels == "maxq" else maxq + 1)
    if fp16:
        scale = scale.half().float()
    zero = sign * -lo / scale
    return scale, (torch.round(zero) if round_zero else zero).clamp(0, maxq).long()


def rtn_cases() -> list[Case]:
    w = torch.tensor([[-1.0, 0.5, 2.0], [0.25, 0.5, 1.5], [0.0, 0.0, 0.0]])
    # row 0: range [-1, 2], 4 bits: scale 3/15 = 0.2 (float16 0.199951...), zero round(1 / 0.19995) = 5
    # row 1: all positive, the range still includes 0: [0, 1.5], scale 0.1, zero 0
    # row 2: all zero: range [-1, 1] so nothing divides by zero, scale 2/15, zero round(7.5) = 8 (half to even)
    scale = torch.tensor([3 / 15, 1.5 / 15, 2 / 15]).half().float()
    return [
        Case("three rows at 4 bits: a mixed row, a positive row (0 stays in range), an all-zero row", (w, 4),
             (scale, torch.tensor([5, 0, 8]))),
        Case("2 bits: [-3, 0, 3] on codes 0..3", (torch.tensor([[-3.0, 0.0, 3.0]]), 2),
             (torch.tensor([2.0]), torch.tensor([2]))),
    ]


def rtn_random(g) -> list[Case]:
    return [Case(f"random {i + 1} ({o} rows of {n}, {b} bits)", ((torch.randn(o, n, generator=g) + shift), b))
            for i, (o, n, b, shift) in enumerate(((4, 64, 4, 0.0), (8, 32, 3, 0.3), (3, 128, 8, -0.5),
                                                  (5, 16, 2, 2.0)))]


def judge_rtn(case: Case, expected, got, args) -> Failure | None:
    s_exp, z_exp = expected
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        return Failure(describe(expected), describe(got), "return the pair (scale, zero)")
    scale, zero = got
    problem = tensor_problem(scale, s_exp.shape, what="scale") or tensor_problem(zero, z_exp.shape, what="zero")
    if problem:
        return Failure(describe(expected), describe(got), problem)
    if same_tensor(scale.float(), s_exp, atol=0, rtol=1e-6) and torch.equal(zero.round().long(), z_exp):
        return None
    w, bits = case.args

    def wrong(**kw):
        return lambda: _rtn(w, bits, **kw)

    mutants = [
        (wrong(include_zero=False), "the range must include 0 (min <= 0 <= max), so that a zero weight stays "
                                    "exactly zero: widen the row's range to 0 first"),
        (wrong(fp16=False), "the file stores scales in float16: round the scale to float16 before computing the "
                            "zero point from it"),
        (wrong(levels="2^b"), "b bits give 2^b codes and 2^b - 1 steps between them: the range is split into "
                              "2^b - 1 steps"),
        (wrong(round_zero=False), "the zero point is a code: round it to an integer"),
        (wrong(sign=-1), "the zero point is the code of the weight 0: -min / scale, a code >= 0"),
    ]
    hint = first_match((scale.float(), zero.float().round().long()), mutants,
                       lambda a, b: same_tensor(a[0], b[0], atol=0, rtol=1e-6) and torch.equal(a[1], b[1]))
    if hint is None and not torch.isfinite(scale).all() or hint is None and (scale == 0).any():
        hint = "an all-zero row has no range: give it the range [-1, 1] so that nothing divides by zero"
    return Failure(describe(expected), describe(got), hint or (
        "take one row of this case and do it by hand: its range, the step between codes, the code of 0"))


RTN = Exercise(
    name="rtn_scale_zero",
    signature="rtn_scale_zero(w (O, I), bits) -> (scale (O,) float32 holding float16 values, zero (O,) int)",
    notebook="14_quant_formats.ipynb",
    follows="minillm.quant.rtn.find_params (asymmetric, group_size -1)",
    reference=reference_rtn,
    hand_cases=rtn_cases,
    random_cases=rtn_random,
    judge=judge_rtn,
    forbidden=("minillm.quant.rtn.find_params", "minillm.quant.rtn.rtn_quantize", "minillm.quant.rtn._scale_zero"),
)


# ---------------------------------------------------------------------------------------------
# pack_q4k_scales


def reference_pack(scales, mins):
    return pack_q4_k_scales(scales.to(torch.int32), mins.to(torch.int32))


def _pack(sc, m, *, shift=6, nibbles="sc low", high_from="high"):
    sc, m = sc.to(torch.int32), m.to(torch.int32)
    top = (lambda x: x >> 4) if high_from == "high" else (lambda x: x & 3)
    lo = sc[:, :4] | (top(sc[:, 4:]) << shift)
    mid = m[:, :4] | (top(m[:, 4:]) << shift)
    a, b = (sc[:, 4:] & 0xF, m[:, 4:] & 0xF) if nibbles == "sc low" else (m[:, 4:] & 0xF, sc[:, 4:] & 0xF)
    return (torch.cat([lo, mid, a | (b << 4)], 1) & 0xFF).to(torch.uint8)


def pack_cases() -> list[Case]:
    sc = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]], dtype=torch.uint8)
    m = torch.tensor([[0, 0, 0, 0, 0, 0, 0, 0]], dtype=torch.uint8)
    big = torch.tensor([[63, 0, 0, 0, 63, 17, 32, 48]], dtype=torch.uint8)
    return [
        Case("small scales (no high bits), mins 0: bytes 8-11 hold the scales 4..7 in their low nibbles",
             (sc, m), torch.tensor([[1, 2, 3, 4, 0, 0, 0, 0, 5, 6, 7, 8]], dtype=torch.uint8)),
        # sc[4] = 63 = 0b11_1111: low nibble 15 into byte 8, high 2 bits (3) into byte 0's top bits: 63 | 3 << 6 = 255
        Case("large values: the high 2 bits of sc[4..7] ride in the top of bytes 0-3", (big, m), torch.tensor(
            [[255, 64, 128, 192, 0, 0, 0, 0, 15, 1, 0, 0]], dtype=torch.uint8)),
        Case("mins go to bytes 4-7 and the high nibbles of bytes 8-11", (m, big), torch.tensor(
            [[0, 0, 0, 0, 255, 64, 128, 192, 240, 16, 0, 0]], dtype=torch.uint8)),
    ]


def pack_random(g) -> list[Case]:
    return [Case(f"random {i + 1} ({n} super-blocks)", (torch.randint(0, 64, (n, 8), generator=g).to(torch.uint8),
                                                       torch.randint(0, 64, (n, 8), generator=g).to(torch.uint8)))
            for i, n in enumerate((1, 4, 16))]


def judge_pack(case: Case, expected, got, args) -> Failure | None:
    problem = tensor_problem(got, expected.shape, floating=False, what="the packed bytes")
    if problem:
        return Failure(describe(expected), describe(got), problem)
    if torch.equal(got.long() & 0xFF, expected.long()) and got.long().max() < 256 and got.long().min() >= 0:
        return None
    sc, m = case.args

    def wrong(**kw):
        return lambda: _pack(sc, m, **kw)

    mutants = [
        (wrong(shift=4), "bytes 0-7 keep the 6 low bits of sc[0..3] / m[0..3]; the 2 spare bits on top (<< 6) "
                         "carry the high bits of sc[4..7] / m[4..7]"),
        (wrong(nibbles="m low"), "bytes 8-11: the scale's 4 low bits in the low nibble, the min's in the high one"),
        (wrong(high_from="low"), "the 2 bits that go on top of bytes 0-7 are the high bits of a 6-bit value: "
                                 "value >> 4"),
    ]
    hint = first_match(got, mutants, lambda a, b: torch.equal(a.long() & 0xFF, b.long()))
    if hint is None and got.long().max() > 255:
        hint = "a byte holds 8 bits: values above 255 mean bits were shifted out of place"
    if hint is None:
        i = int((got.long() != expected.long()).nonzero()[0, 1])
        hint = (f"byte {i} differs first: write the 6-bit values in binary and place their bits by hand; which "
                "value's bits belong in that byte?")
    return Failure(describe(expected), describe(got), hint)


PACK = Exercise(
    name="pack_q4k_scales",
    signature="pack_q4k_scales(scales (N, 8) uint8 0..63, mins (N, 8) uint8 0..63) -> (N, 12) uint8",
    notebook="14_quant_formats.ipynb",
    follows="minillm.formats.kquants.pack_q4_k_scales (llama.cpp's Q4_K scale layout)",
    reference=reference_pack,
    hand_cases=pack_cases,
    random_cases=pack_random,
    judge=judge_pack,
    forbidden=("minillm.formats.kquants.pack_q4_k_scales",),
)


# ---------------------------------------------------------------------------------------------
# choose_bitrate


def reference_bitrate(errors, costs, budget):
    """``optimize_naive`` on a table of one-weight layers (its objective: the sum of the errors as given)."""
    n_opt = len(costs[0])
    table = {"options": [(k, 0) for k in range(n_opt)], "setup": {"end_to_end": True, "power": 1.0},
             "layers": [{"name": f"layers.{i}.x", "out_features": 1, "in_features": 1, "bits": list(c),
                         "errors": list(e)} for i, (e, c) in enumerate(zip(errors, costs))]}
    result = optimize_naive(table, budget / len(costs))
    return [result["choice"][f"layers.{i}.x"][0] for i in range(len(costs))]


def _greedy(errors, costs, budget, *, order="error"):
    picks, left = [], budget
    for i, (e, c) in enumerate(zip(errors, costs)):
        rest = sum(min(cc) for cc in costs[i + 1:])
        ok = [k for k in range(len(c)) if c[k] + rest <= left]
        k = min(ok, key=lambda k: e[k]) if order == "error" else min(ok, key=lambda k: c[k])
        picks.append(k)
        left -= c[k]
    return picks


def bitrate_cases() -> list[Case]:
    costs = [[2, 4, 8]] * 3
    return [
        Case("a budget of 24 bits affords the best option everywhere", ([[9, 3, 1], [9, 3, 1], [9, 3, 1]], costs, 24),
             [2, 2, 2]),
        Case("16 bits: the sensitive layer gets 8 bits, the others 4", ([[9, 3, 1], [90, 30, 1], [9, 3, 1]], costs, 16),
             [1, 2, 1]),
        Case("greedy fails: layer 0 should give up its best option",
             ([[10, 9, 0], [100, 1, 0], [100, 1, 0]], costs, 12), [1, 1, 1]),
        Case("the cheapest everywhere, exactly the budget", ([[5, 1, 0]] * 2, [[2, 4, 8]] * 2, 4), [0, 0]),
    ]


def bitrate_random(g) -> list[Case]:
    cases = []
    for i, (layers, opts) in enumerate(((4, 3), (4, 4), (2, 3), (4, 2))):
        costs = [sorted(torch.randint(1, 20, (opts,), generator=g).tolist()) for _ in range(layers)]
        errors = [sorted((torch.rand(opts, generator=g) * 10).tolist(), reverse=True) for _ in range(layers)]
        lo, hi = sum(min(c) for c in costs), sum(max(c) for c in costs)
        budget = int(lo + (hi - lo) * float(torch.rand((), generator=g)))
        cases.append(Case(f"random {i + 1} ({layers} layers, {opts} options, {budget} bits)", (errors, costs, budget)))
    return cases


def judge_bitrate(case: Case, expected, got, args) -> Failure | None:
    errors, costs, budget = case.args
    if isinstance(got, torch.Tensor):
        got = got.tolist()
    if not isinstance(got, (list, tuple)) or len(got) != len(costs) or not all(
            isinstance(k, int) and 0 <= k < len(c) for k, c in zip(got, costs)):
        return Failure(describe(expected), describe(got), f"return one option index per layer ({len(costs)} ints), "
                       f"got {kind(got)}")
    if list(got) == list(expected):
        return None
    spent = sum(c[k] for c, k in zip(costs, got))
    total = sum(e[k] for e, k in zip(errors, got))
    best = sum(e[k] for e, k in zip(errors, expected))
    if spent > budget:
        hint = f"your choice costs {spent} bits, over the budget of {budget}: the total must fit"
    elif abs(total - best) <= 1e-9:
        hint = "another choice with the same total error: break ties by the first option listed"
    elif list(got) == _greedy(errors, costs, budget):
        hint = ("layer by layer, the best option that leaves room for the rest is greedy, and greedy is not optimal "
                "here: compare every way to spend the budget (dynamic programming over bits, or every combination)")
    elif list(got) == _greedy(errors, costs, budget, order="cost"):
        hint = "the cheapest option everywhere fits but wastes the budget: spend it where the error drops most"
    else:
        hint = f"your total error is {total:.4g}, the best that fits is {best:.4g}: which layers should change?"
    return Failure(describe(expected), describe(list(got)), hint)


BITRATE = Exercise(
    name="choose_bitrate",
    signature="choose_bitrate(errors [[per option] per layer], costs (bits, same shape), budget) -> option per layer",
    notebook="14_quant_formats.ipynb",
    follows="minillm.quant.bitrate.optimize / optimize_naive (ExLlamaV2's variable bitrate)",
    reference=reference_bitrate,
    hand_cases=bitrate_cases,
    random_cases=bitrate_random,
    judge=judge_bitrate,
    forbidden=("minillm.quant.bitrate.optimize", "minillm.quant.bitrate.optimize_naive"),
)

FORMAT_EXERCISES = (RTN, PACK, BITRATE)

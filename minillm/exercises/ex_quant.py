"""Exercises 8 and 9: GPTQ's column loop and AWQ's scale search. They follow
``minillm.quant.gptq.gptq_quantize`` (Frantar et al. 2023, Sec. 3, Algorithm 1) and
``minillm.quant.awq.search_scales`` (Lin et al. 2024, Sec. 3.2-3.3)."""

from __future__ import annotations

import torch

from ..quant import QuantConfig, rtn_quantize
from ..quant.awq import search_scales
from ..quant.gptq import gptq_quantize
from ..quant.rtn import find_params, quantize_codes
from .checker import Case, Exercise, Failure, close, describe, first_match, number_problem, same_tensor, tensor_problem

# ---------------------------------------------------------------------------------------------
# 8. gptq_quantize_columns


def reference_gptq(W, H, scale, zero, maxq, percdamp=0.01):
    config = QuantConfig(bits=(maxq + 1).bit_length() - 1, group_size=-1)
    return gptq_quantize(W, H, config, percdamp=percdamp).codes.long()


def _gptq(W, H, scale, zero, maxq, percdamp=0.01, *, damp=True, feedback=True, divide=True, dead=True,
          inverse="cholesky"):
    """GPTQ's loop written out, with the switches of the typical mistakes."""
    W, H = W.clone().double(), H.clone().double()
    if dead:
        d = torch.diag(H) == 0
        H[d, d] = 1.0
        W[:, d] = 0.0
    if damp:
        H = H + percdamp * torch.diag(H).mean() * torch.eye(H.shape[0], dtype=H.dtype)
    Hinv = torch.linalg.inv(H)
    U = torch.linalg.cholesky(Hinv, upper=True) if inverse == "cholesky" else Hinv
    codes = torch.zeros(W.shape, dtype=torch.int64)
    for i in range(W.shape[1]):
        q = quantize_codes(W[:, i], scale, zero, maxq)
        codes[:, i] = q
        if feedback:
            err = (W[:, i] - scale.double() * (q - zero).double()) / (U[i, i] if divide else 1.0)
            W[:, i:] -= err[:, None] * U[i, i:][None, :]
    return codes


def _gptq_case(name, W, X, bits=4, expected=None):
    H = 2 * X.double().t() @ X.double() / X.shape[0]  # (I, I), as minillm.quant.gptq.Hessian accumulates it
    Wd = W.double().clone()
    Wd[:, torch.diag(H) == 0] = 0.0  # GPTQ zeroes the weights of dead inputs before choosing the range
    scale, zero = find_params(Wd, QuantConfig(bits=bits, group_size=-1))
    return Case(name, (W.double(), H, scale, zero, (1 << bits) - 1), expected)


def gptq_cases() -> list[Case]:
    g = torch.Generator().manual_seed(1)
    W = torch.randn(4, 8, generator=g)
    X = torch.randn(64, 8, generator=g)
    X_corr = X.clone()
    X_corr[:, 1] = X[:, 0] + 0.1 * X[:, 1]  # inputs 0 and 1 move together
    X_dead = X.clone()
    X_dead[:, 3] = 0.0
    identity = _gptq_case("identity Hessian: nothing to spread, GPTQ is round-to-nearest", W, 2 * torch.eye(8))  # H = I
    W0, _, scale, zero, maxq = identity.args
    identity.expected = quantize_codes(W0, scale[:, None], zero[:, None], maxq).long()  # plain rounding
    return [
        identity,
        _gptq_case("two correlated inputs: the second column absorbs the first's error", W, X_corr),
        _gptq_case("a dead input column (always zero)", W, X_dead),
        _gptq_case("fewer calibration tokens than inputs (H singular until dampened)", W, X[:3]),
        _gptq_case("3 bits, 16 x 32 layer with one large input channel", torch.randn(16, 32, generator=g),
                   torch.randn(128, 32, generator=g) * torch.cat([torch.tensor([10.0]), torch.ones(31)]), bits=3),
    ]


def gptq_random(g: torch.Generator) -> list[Case]:
    cases = []
    for i in range(3):
        O, I = 8 * int(torch.randint(1, 4, (), generator=g)), 8 * int(torch.randint(1, 5, (), generator=g))
        X = torch.randn(4 * I, I, generator=g) @ torch.randn(I, I, generator=g)  # correlated inputs
        bits = (3, 4, 2)[i]
        cases.append(_gptq_case(f"random {i + 1} ({O} x {I}, {bits} bits)", torch.randn(O, I, generator=g), X, bits))
    return cases


DAMP_HINT = ("dampen H first: H += percdamp * mean(diag H) * I (GPTQ Sec. 3, step 3); with fewer calibration "
             "tokens than inputs H is singular and its Cholesky factor does not exist")


def judge_gptq(case: Case, expected, got, args) -> Failure | None:
    W, H, scale, zero, maxq = case.args
    problem = tensor_problem(got, W.shape)
    if problem is None and got.is_floating_point():
        problem = f"the codes should be integers (torch.int64), got dtype {got.dtype}"
    if problem:
        singular = torch.linalg.matrix_rank(H) < H.shape[0]
        return Failure(describe(expected), describe(got), problem + (f"; {DAMP_HINT}" if singular else ""))
    mismatch = float((got.long() != expected).double().mean())
    if mismatch <= 0.01:  # float rounding can flip a code that sits on a rounding boundary
        return None

    def wrong(**kw):
        return lambda: _gptq(W, H, scale, zero, maxq, **kw)

    mutants = [
        (wrong(feedback=False), "no error feedback (that is round-to-nearest): after quantizing column i, subtract "
                                "err * U[i, i:] from the columns not yet quantized"),
        (wrong(divide=False), "divide the column's error by U[i, i] (the OBS step, Eq. 3): err = (w - q) / U[i, i]"),
        (wrong(dead=False), "an input that is always zero has H[j, j] = 0: set H[j, j] = 1 and W[:, j] = 0 "
                            "(its weights never matter)"),
        (wrong(inverse="plain"), "row i of the plain inverse Hessian is stale after column i-1 is done: use the upper "
                                 "Cholesky factor U of H^-1 (U^T U = H^-1), whose row i is the updated one"),
    ]
    hint = first_match(got, mutants, lambda a, b: float((a.long() != b).double().mean()) <= 0.01)
    return Failure(describe(expected), describe(got), (hint or "codes differ from GPTQ's; step through the loop "
                   "on this case") + f" ({mismatch:.0%} of the codes differ)")


def gptq_error_hint(case: Case, error: str, message: str) -> str | None:
    text = message.lower()
    if error == "torch.linalg.LinAlgError" or "positive-definite" in text or "singular" in text:
        return DAMP_HINT
    return None


GPTQ = Exercise(
    name="gptq_quantize_columns",
    signature=("gptq_quantize_columns(W (O, I), H (I, I), scale (O,), zero (O,), maxq, percdamp=0.01) "
               "-> codes (O, I) int64"),
    notebook="08_gptq_column.ipynb",
    follows="minillm.quant.gptq.gptq_quantize (group_size=-1)",
    reference=reference_gptq,
    forbidden=("minillm.quant.gptq.gptq_quantize", "minillm.quant.gptq.gptq_quantize_naive",
               "minillm.quant.gptq.inverse_hessian_cholesky"),
    hand_cases=gptq_cases,
    random_cases=gptq_random,
    judge=judge_gptq,
    error_hint=gptq_error_hint,
)


# ---------------------------------------------------------------------------------------------
# 9. awq_search_scale


def reference_awq(x, W, config, n_grid=20):
    s, alpha, _ = search_scales(x, [W], config, n_grid)
    return s, alpha


def _awq(x, W, config, n_grid=20, *, divide=True, normalise=True, magnitude="mean", power=1.0, grid="open"):
    """The search written out, with the switches of the typical mistakes."""
    x, W = x.float(), W.float()
    ref = x @ W.t()
    sx = (x.abs().mean(0) if magnitude == "mean" else x.abs().amax(0)).clamp(min=1e-8)
    alphas = [i / n_grid for i in range(n_grid)] if grid == "open" else torch.linspace(0, 1, n_grid).tolist()
    best = (float("inf"), None, 0.0)
    for alpha in alphas:
        s = sx.pow(power * alpha)
        if normalise:
            s = s / (s.max() * s.min()).sqrt()
        Wq = rtn_quantize(W * s, config).dequantize()
        err = (x @ (Wq / s if divide else Wq).t() - ref).pow(2).mean().item()
        if err < best[0]:
            best = (err, s, alpha)
    return best[1], best[2]


def _awq_case(name, x, W, bits=3, group_size=16, n_grid=20, expected=None):
    return Case(name, (x, W, QuantConfig(bits=bits, group_size=group_size), n_grid), expected)


def awq_cases() -> list[Case]:
    g = torch.Generator().manual_seed(2)
    W = torch.randn(16, 32, generator=g)
    x = torch.randn(64, 32, generator=g)
    salient = x * torch.cat([torch.full((3,), 30.0), torch.ones(29)])
    dead = salient.clone()
    dead[:, 5] = 0.0
    return [
        _awq_case("n_grid = 1: only alpha = 0 (s = 1, plain round-to-nearest)", salient, W, n_grid=1,
                  expected=(torch.ones(32), 0.0)),
        _awq_case("three salient input channels (30 x larger activations)", salient, W),
        _awq_case("a dead input channel (always zero)", dead, W),
        _awq_case("4 bits, group size 32", salient, W, bits=4, group_size=32),
    ]


def awq_random(g: torch.Generator) -> list[Case]:
    cases = []
    for i in range(3):
        I, O = 32, 8 * int(torch.randint(1, 4, (), generator=g))
        x = torch.randn(48, I, generator=g) * torch.rand(I, generator=g).mul(4).exp()  # channel scales 1..e^4
        cases.append(_awq_case(f"random {i + 1} ({O} x {I}, 3 bits, group 16)", x, torch.randn(O, I, generator=g)))
    return cases


DEAD_CHANNEL_HINT = "a channel that is always zero has mean |x| = 0: clamp it at 1e-8 before the power"


def judge_awq(case: Case, expected, got, args) -> Failure | None:
    x, W, config, n_grid = case.args
    s_exp, a_exp = expected
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        return Failure(describe(expected), describe(got), "return the pair (s, alpha)")
    s, alpha = got
    problem = tensor_problem(s, (x.shape[1],), what="s") or number_problem(alpha, "alpha")
    dead = bool((x.abs().sum(0) == 0).any())
    if problem:
        hint = f"; {DEAD_CHANNEL_HINT}" if dead else ""
        return Failure(describe(expected), describe(got), problem + hint)
    if close(alpha, a_exp, 1e-6) and same_tensor(s.float(), s_exp, atol=1e-6, rtol=1e-4):
        return None

    def wrong(**kw):
        return lambda: _awq(x, W, config, n_grid, **kw)

    mutants = [
        (wrong(divide=False), "W x = (W diag(s)) (diag(s)^-1 x): after quantizing W diag(s), divide by s (or feed "
                              "x / s) before comparing with W x"),
        (wrong(normalise=False), "normalise s by sqrt(max(s) * min(s)) (the AWQ code does; it keeps s around 1)"),
        (wrong(magnitude="max"), "AWQ's s_x is the mean |x| of each input channel over the tokens, not the max"),
        (wrong(power=-1.0), "salient channels get s > 1: s = s_x^alpha, not s_x^-alpha"),
        (wrong(grid="closed"), "alpha runs over {0, 1/n_grid, ..., (n_grid - 1)/n_grid}: n_grid values, 1 excluded"),
    ]

    def equal(a, b):
        return close(a[1], b[1], 1e-6) and same_tensor(a[0].float(), b[0], atol=1e-6, rtol=1e-4)

    hint = first_match(got, mutants, equal)
    ratio = s.float() / s_exp
    if hint is None and close(alpha, a_exp, 1e-6) and same_tensor(ratio, torch.full_like(ratio, float(ratio[0]))):
        hint = "normalise s by sqrt(max(s) * min(s))"
    if hint is None and dead:
        hint = DEAD_CHANNEL_HINT
    return Failure(describe(expected), describe(got), hint or (
        f"your alpha is {float(alpha):g}, the search's {a_exp:g}: print your error at every alpha of the grid and "
        "check each step of the docstring in turn (the statistic of x, the normalisation, where s is undone)"))


def awq_error_hint(case: Case, error: str, message: str) -> str | None:
    return DEAD_CHANNEL_HINT if bool((case.args[0].abs().sum(0) == 0).any()) else None


AWQ = Exercise(
    name="awq_search_scale",
    signature="awq_search_scale(x (n, I), W (O, I), config, n_grid=20) -> (s (I,) float32, alpha)",
    notebook="09_awq_scales.ipynb",
    follows="minillm.quant.awq.search_scales",
    reference=reference_awq,
    forbidden=("minillm.quant.awq.search_scales",),
    tools=("minillm.quant.rtn",),  # the docstring's Q(M) = rtn_quantize(M, config).dequantize()
    hand_cases=awq_cases,
    random_cases=awq_random,
    judge=judge_awq,
    error_hint=awq_error_hint,
)

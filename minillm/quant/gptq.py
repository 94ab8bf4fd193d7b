"""GPTQ: quantize a linear layer's weight one input column at a time, pushing each column's rounding
error onto the columns not yet quantized so that the layer's *output* error on calibration inputs
stays small (Frantar, Ashkboos, Hoefler, Alistarh, "GPTQ", ICLR 2023, Sec. 3, Algorithm 1).

For ``|| W X - W_hat X ||^2`` the Hessian of a row is ``H = 2 X^T X`` (I, I); quantizing column i and
updating the later columns by ``-e [H^-1]_{i, i+1:}`` is the Optimal Brain Surgeon step (Eq. 2-3),
made fast by a fixed column order (``act_order``: by decreasing ``diag(H)``), lazy batch updates of
``blocksize`` columns and the Cholesky factor of the dampened ``H^-1``. ``gptq_quantize_naive`` is the
baseline with the same signature: the OBS update on the full inverse, one row and column per step.

``asymmetric_target`` is GPTQv2's asymmetric calibration (Li et al. 2025): the float model's inputs X_f
differ from the quantized model's X, and completing the square turns ``|| W X_f - W_hat X ||^2`` into
the ordinary objective on another target weight ``W* = W + W C H^-1`` with ``C = (X_f - X) X^T``.
docs/quant_methods.md gives both derivations, dead inputs, static groups and ``g_idx``.
"""

from __future__ import annotations

import torch

from .rtn import QuantConfig, QuantizedWeight, find_params, group_index, quantize_codes, dequantize_codes


class Hessian:
    """Accumulates ``H = 2 / n * sum_x x x^T`` (I, I) over calibration inputs x (..., I) and, when the
    float model's inputs x_f of the same tokens are given, ``dXXT = 2 / n * sum (x_f - x) x^T`` (I, I)
    for asymmetric calibration (``asymmetric_target``; None until then).

    n counts token vectors. The products run in float32 (float64 matmuls are ~10x slower on the CPU)
    and are summed into float64.
    """

    def __init__(self, in_features: int, device="cpu"):
        self.H = torch.zeros(in_features, in_features, dtype=torch.float64, device=device)
        self.dXXT = None
        self.n = 0

    def add_batch(self, x: torch.Tensor, x_float: torch.Tensor | None = None) -> None:
        x = x.reshape(-1, x.shape[-1]).float()  # (n, I)
        m = x.shape[0]
        keep = self.n / (self.n + m)
        self.H *= keep
        self.n += m
        c = (2.0 / self.n) ** 0.5
        if x_float is not None:
            dx = (x_float.reshape(-1, x.shape[-1]).float() - x) * c  # (n, I)
            if self.dXXT is None:
                self.dXXT = torch.zeros_like(self.H)
            self.dXXT *= keep
            self.dXXT += (dx.t() @ (x * c)).double()
        x = x * c
        self.H += (x.t() @ x).double()


def asymmetric_target(weight: torch.Tensor, H: torch.Tensor, dXXT: torch.Tensor, percdamp: float = 0.01,
                      alpha: float = 1.0) -> torch.Tensor:
    """GPTQv2's target weight (O, I) float64: ``W + alpha * W dXXT (H + damp)^-1`` (module docstring).

    With alpha = 1 and no dampening it is the least-squares weight mapping the quantized model's inputs X
    onto the float layer's outputs on the float model's inputs (tested against ``torch.linalg.lstsq``); with
    dampening ``percdamp * mean(diag H)`` (as in ``gptq_quantize``) it is the ridge regression toward W
    (tested). Dead inputs as in ``gptq_quantize``.
    """
    if dXXT.shape != H.shape:
        raise ValueError(f"dXXT: expected {tuple(H.shape)} like H, got {tuple(dXXT.shape)}")
    W = weight.double()
    H = H.clone().double()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    correction = torch.linalg.solve(_damp(H, percdamp), dXXT.double().t() @ W.t()).t()  # W C H^-1, H symmetric
    return W + alpha * correction


def _prepare(weight: torch.Tensor, H: torch.Tensor, config: QuantConfig, act_order: bool, static_groups: bool):
    """Common start of both paths: dead inputs, static groups, act-order permutation, dampening."""
    if weight.dim() != 2 or H.shape != (weight.shape[1], weight.shape[1]):
        raise ValueError(f"H: expected ({weight.shape[-1]}, {weight.shape[-1]}) for a weight of shape "
                         f"{tuple(weight.shape)}, got {tuple(H.shape)}")
    if not torch.isfinite(weight).all() or not torch.isfinite(H).all():
        raise ValueError("weight/H: hold NaN or inf (check the calibration activations)")
    W = weight.clone().double()
    H = H.clone().double()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    O, I = W.shape
    g = config.group_of_columns(I)
    groups = None  # static: (scales, zeros) of every group from the original weight
    if config.group_size == -1 or static_groups:
        groups = [find_params(W[:, s:s + g], config) for s in range(0, I, g)]
    perm = torch.argsort(torch.diag(H), descending=True) if act_order else torch.arange(I, device=H.device)
    W, H = W[:, perm], H[perm][:, perm]
    return W, H, perm, groups, g


def _damp(H: torch.Tensor, percdamp: float) -> torch.Tensor:
    if not 0 <= percdamp < 1:
        raise ValueError(f"percdamp: must be in [0, 1), got {percdamp}")
    H = H.clone()
    H.diagonal().add_(percdamp * torch.mean(torch.diag(H)))
    return H


def _params_for(col: int, perm, groups, g, config, current):
    """(scale, zero) of the group column ``col`` (in quantization order) belongs to, and whether a new
    dynamic group starts there. ``current()`` returns the up-to-date columns col..col+g."""
    if groups is not None:  # per-channel or static groups: indexed by the column's original position
        return groups[int(perm[col]) // g], False
    if col % g == 0:
        return find_params(current(), config), True
    return None, False


def inverse_hessian_cholesky(H: torch.Tensor, percdamp: float = 0.01) -> torch.Tensor:
    """The upper Cholesky factor U of ``(H + percdamp * mean(diag H) * I)^-1`` (I, I), ``U^T U = H^-1``.

    Row i of U, divided by U_ii, is row i of the inverse Hessian after columns 0..i-1 were eliminated:
    everything the OBS step needs, from one factorisation (paper Sec. 3, Step 3).

    Raises:
        ValueError: H is not positive definite even after dampening (raise percdamp).
    """
    try:
        L = torch.linalg.cholesky(_damp(H, percdamp))
        return torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True)
    except torch.linalg.LinAlgError as e:
        raise ValueError(f"H: not positive definite after dampening {percdamp}; raise percdamp") from e


def _finish(codes, scales, zeros, perm, g, config, dynamic_groups):
    inv = torch.argsort(perm)
    codes = codes[:, inv].to(torch.int32)
    I = codes.shape[1]
    if dynamic_groups:  # group k = permuted columns k*g .. (k+1)*g - 1
        g_idx = (inv // g).to(torch.int32)
    else:
        g_idx = group_index(I, config)
    return QuantizedWeight(codes, torch.stack(scales, 1).float(), torch.stack(zeros, 1).to(torch.int32), g_idx, config)


def gptq_quantize(weight: torch.Tensor, H: torch.Tensor, config: QuantConfig, *, blocksize: int = 128,
                  percdamp: float = 0.01, act_order: bool = False, static_groups: bool = False) -> QuantizedWeight:
    """GPTQ for one layer (Algorithm 1).

    Args:
        weight: (O, I) float.
        H: (I, I) the Hessian ``2 X^T X / n`` of the layer's calibration inputs (``Hessian``).
        config: bits, group_size (-1 = per channel), sym.
        blocksize: columns per lazy batch (does not change the result, only the speed).
        percdamp: dampening, a fraction of the mean diagonal of H (paper: 1%).
        act_order: quantize columns in order of decreasing ``diag(H)`` (largest activations first).
        static_groups: with act_order, fix every group's scale/zero from the original weight first.

    Returns:
        QuantizedWeight; its ``dequantize()`` is the weight GPTQ chose (float32).

    Raises:
        ValueError: shapes disagree, non-finite values, bad percdamp, or H not positive definite
            even after dampening (raise percdamp).
    """
    W, H, perm, groups, g = _prepare(weight, H, config, act_order, static_groups)
    O, I = W.shape
    Hinv = inverse_hessian_cholesky(H, percdamp)  # (I, I) upper
    codes = torch.zeros(O, I, dtype=torch.int64, device=W.device)
    scales, zeros = [], []
    scale = zero = None
    for i1 in range(0, I, blocksize):
        i2 = min(i1 + blocksize, I)
        W1 = W[:, i1:i2].clone()
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i

            def current():
                # columns col..col+g with every error so far applied: those inside this block are
                # up to date in W1; those past it still miss this block's pending (lazy) update
                inside = W1[:, i:i + g]
                if col + g <= i2:
                    return inside
                rest = W[:, i2:col + g] - Err1[:, :i] @ Hinv[i1:i1 + i, i2:col + g]
                return torch.cat([inside, rest], dim=1)

            params, new = _params_for(col, perm, groups, g, config, current)
            if params is not None:
                scale, zero = params
                if new:
                    scales.append(scale)
                    zeros.append(zero)
            w = W1[:, i]
            q = quantize_codes(w, scale, zero, config.maxq)
            codes[:, col] = q
            err = (w - dequantize_codes(q, scale, zero).double()) / Hinv1[i, i]
            W1[:, i:] -= err[:, None] * Hinv1[i, i:][None, :]
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]
    if groups is not None:
        scales, zeros = [s for s, _ in groups], [z for _, z in groups]
    return _finish(codes, scales, zeros, perm, g, config, dynamic_groups=groups is None)


def gptq_quantize_naive(weight: torch.Tensor, H: torch.Tensor, config: QuantConfig, *, blocksize: int = 128,
                        percdamp: float = 0.01, act_order: bool = False, static_groups: bool = False) -> QuantizedWeight:
    """The baseline of ``gptq_quantize`` (same signature and result up to float rounding): after each
    column, update all later columns with the OBS step on the full inverse Hessian and then remove
    that column from the inverse by Gaussian elimination (paper Eq. 3). ``blocksize`` is ignored."""
    W, H, perm, groups, g = _prepare(weight, H, config, act_order, static_groups)
    O, I = W.shape
    Hinv = torch.linalg.inv(_damp(H, percdamp))
    codes = torch.zeros(O, I, dtype=torch.int64, device=W.device)
    scales, zeros = [], []
    scale = zero = None
    for col in range(I):
        params, new = _params_for(col, perm, groups, g, config, lambda: W[:, col:col + g])
        if params is not None:
            scale, zero = params
            if new:
                scales.append(scale)
                zeros.append(zero)
        q = quantize_codes(W[:, col], scale, zero, config.maxq)
        codes[:, col] = q
        err = (W[:, col] - dequantize_codes(q, scale, zero).double()) / Hinv[col, col]
        W[:, col:] -= err[:, None] * Hinv[col, col:][None, :]
        Hinv = Hinv - Hinv[:, col:col + 1] @ Hinv[col:col + 1, :] / Hinv[col, col]  # eliminate column col
    if groups is not None:
        scales, zeros = [s for s, _ in groups], [z for _, z in groups]
    return _finish(codes, scales, zeros, perm, g, config, dynamic_groups=groups is None)

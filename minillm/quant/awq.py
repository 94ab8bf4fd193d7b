"""AWQ: activation-aware weight quantization (Lin et al., "AWQ", MLSys 2024).

A few input channels carry much larger activations than the rest; AWQ protects the weights that multiply
them by scaling: ``W x = (W diag(s)) (diag(s)^-1 x)``, quantizing ``W diag(s)`` and folding ``1/s`` into
whatever produced x (an RMSNorm weight, or the rows of the layer before), so the float model computes
exactly the same function (tested) and no extra op runs (Sec. 3.2).

``search_scales`` (Sec. 3.3, Eq. 5): ``s = s_x^alpha``, alpha on a grid minimising the output error of the
layers that read that input. ``search_clip``: then shrink each group's range where that lowers its output
error (query and key rows are not clipped, as in the AWQ code). docs/quant_methods.md lists the foldings
for Llama blocks (with GQA, SmolLM2's case, o is not scaled, as in AutoAWQ).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from .rtn import QuantConfig, fake_quantize, find_params, rtn_quantize


def channel_magnitude(x: torch.Tensor) -> torch.Tensor:
    """Mean |x| per input channel: x (..., I) -> (I,) float32."""
    return x.reshape(-1, x.shape[-1]).abs().float().mean(dim=0)


def search_scales(x: torch.Tensor, weights: list[torch.Tensor], config: QuantConfig, n_grid: int = 20
                  ) -> tuple[torch.Tensor, float, list[float]]:
    """Best AWQ scales for layers that all read ``x``.

    Args:
        x: (n, I) calibration inputs of the layers (a subsample of tokens is enough).
        weights: float weights (O_k, I) of the layers reading x (their outputs are compared together).
        config: the quantization applied after scaling (RTN in the search).
        n_grid: alpha in {0, 1/n_grid, ..., (n_grid - 1)/n_grid}; alpha = 0 is plain RTN (s = 1).

    Returns:
        (s (I,) float32, best alpha, the output error (mean squared) at every alpha).
    """
    config = replace(config, mse=False)  # min / max inside the search (a range search per alpha costs ~80x)
    x = x.reshape(-1, x.shape[-1]).float()
    W = torch.cat(weights).float()  # (sum O_k, I)
    ref = x @ W.t()
    sx = channel_magnitude(x).clamp(min=1e-8)
    errors, best = [], (float("inf"), None, 0.0)
    for i in range(n_grid):
        alpha = i / n_grid
        s = sx.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()
        Wq = rtn_quantize(W * s, config).dequantize() / s
        err = (x @ Wq.t() - ref).pow(2).mean().item()
        errors.append(err)
        if err < best[0]:
            best = (err, s, alpha)
    return best[1], best[2], errors


def fold_scales(prev: torch.Tensor, weights: list[torch.Tensor], s: torch.Tensor) -> None:
    """In place: ``prev /= s`` (an RMSNorm weight (I,) or rows (I, ...) of the previous linear layer,
    indexed by its output) and ``W[:, j] *= s[j]`` for every W in ``weights``. The float function is
    unchanged: W diag(s) diag(s)^-1 x = W x."""
    prev.div_(s.to(prev.dtype).view(-1, *([1] * (prev.dim() - 1))))
    for W in weights:
        W.mul_(s.to(W.dtype)[None, :])


def _grouped(W: torch.Tensor, x: torch.Tensor, g: int):
    """Pad the input dim to a multiple of g and split: W (O, I) -> (O, ng, g); x (n, I) -> (n, ng, g)."""
    pad = (-W.shape[1]) % g
    if pad:
        W = torch.cat([W, W.new_zeros(W.shape[0], pad)], 1)
        x = torch.cat([x, x.new_zeros(x.shape[0], pad)], 1)
    return W.reshape(W.shape[0], -1, g), x.reshape(x.shape[0], -1, g)


def search_clip(W: torch.Tensor, x: torch.Tensor, config: QuantConfig, rows: slice | None = None, n_grid: int = 20,
                max_shrink: float = 0.5, chunk: int = 256) -> torch.Tensor:
    """AWQ's weight clipping: the clipped weight (O, I) float32 (unclipped rows copied).

    For each output row and group, tries ranges ``ratio * [min, max]`` for ratio = 1, 1 - 1/n_grid,
    ... down to 1 - max_shrink and keeps the one with the smallest mean squared error of that group's
    contribution to the output on the calibration inputs x (n, I).

    Args:
        rows: the rows that may be clipped (default: all).
    """
    config = replace(config, mse=False)  # this search is AWQ's own range search
    W = W.float()
    out = W.clone()
    rows = rows or slice(0, W.shape[0])
    g = config.group_of_columns(W.shape[1])
    x = x.reshape(-1, x.shape[-1]).float()
    for r0 in range(rows.start, rows.stop, chunk):
        r1 = min(r0 + chunk, rows.stop)
        Wg, xg = _grouped(W[r0:r1], x, g)  # (o, ng, g), (n, ng, g)
        ref = torch.einsum("ngk,ogk->nog", xg, Wg)
        wmax = Wg.amax(dim=-1, keepdim=True).clamp(min=0)
        wmin = Wg.amin(dim=-1, keepdim=True).clamp(max=0)
        best_err = torch.full(Wg.shape[:2], float("inf"), device=Wg.device)
        best = Wg.clone()
        for i in range(int(max_shrink * n_grid) + 1):
            ratio = 1 - i / n_grid
            Wc = torch.maximum(torch.minimum(Wg, wmax * ratio), wmin * ratio)
            flat = Wc.reshape(-1, g)
            scale, zero = find_params(flat, config)
            Wq = fake_quantize(flat, scale[:, None], zero[:, None], config.maxq).reshape(Wg.shape)
            err = (torch.einsum("ngk,ogk->nog", xg, Wq) - ref).pow(2).mean(dim=0)  # (o, ng)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best = torch.where(better[..., None], Wc, best)
        out[r0:r1] = best.reshape(r1 - r0, -1)[:, :W.shape[1]]
    return out

"""llama.cpp's k-quant quantizers (Q4_K, Q6_K), written with torch, and its Q4_K_M recipe.

Quantizing is done twice: each sub-block gets a real-valued scale (and, for Q4_K, a min) from a
weighted search around round-to-nearest (``make_qkx2_quants``, ``make_qx_quants``); then the sub-block
scales are themselves quantized against the super-block's largest one, and the weights re-rounded
against the scales as stored. This is llama.cpp's reference path (``quantize_row_q4_K_ref`` /
``quantize_row_q6_K_ref``, the one ``llama-quantize`` takes without an importance matrix), float
operation for float operation; tests compare the vectorized functions with the per-block loops
(``quantize_q4_k_naive``, ``quantize_q6_k_naive``) and with llama.cpp where it is installed.

"Q4_K_M" is a choice of type per tensor (``q4_k_m_types``): Q4_K everywhere, Q6_K for some
``attn_v`` / ``ffn_down`` layers and the output layer, 32-weight fallbacks where 256 does not divide a
row (F16 where 32 does not either). docs/formats.md gives the search, the scale packing and the recipe in full.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from .gguf_blocks import QK_K

GROUP_MAX_EPS = np.float32(1e-15)  # ggml's threshold for an all-zero group


def _f32(v) -> torch.Tensor:
    """A 0-dim float32 tensor: ``tensor(c) / t`` divides, where ``c / t`` multiplies by a reciprocal."""
    return torch.tensor(np.float32(v), dtype=torch.float32)


def nearest_int(x: torch.Tensor) -> torch.Tensor:
    """ggml's ``nearest_int``: add 1.5 * 2^23 in float32 and read the mantissa bits (halves to even).

    Exact rounding for |x| < 2^22; beyond that it returns what the C returns (such values are always
    clamped or discarded afterwards). x float32 -> int32 of the same shape.
    """
    return ((x.float() + 12582912.0).view(torch.int32) & 0x7FFFFF) - 0x400000


def _sum(t: torch.Tensor, first: bool = False) -> torch.Tensor:
    """(M, n) -> (M,): the C loop's sum, left to right in float32 (``torch.sum`` adds pairwise, which
    rounds differently). ``first``: start from t[:, 0] as the C does for some sums, else from 0."""
    s = t[:, 0].clone() if first else torch.zeros_like(t[:, 0]) + t[:, 0]
    for i in range(1, t.shape[1]):
        s = s + t[:, i]
    return s


def _sqrt(t: torch.Tensor) -> torch.Tensor:
    """Correctly rounded float32 square root (``sqrtf``); torch's vectorized float32 sqrt is not."""
    return t.double().sqrt().float()


def blocks_of(x: torch.Tensor, block: int) -> torch.Tensor:
    """x (..., n) -> float32 (n_blocks, block); ValueError when ``block`` does not divide the rows."""
    x = torch.as_tensor(x).float()
    if x.shape[-1] % block:
        raise ValueError(f"x: rows of {x.shape[-1]} weights are not a multiple of the block size {block}")
    return x.reshape(-1, block)


def f16_bytes(t: torch.Tensor) -> torch.Tensor:
    """(N,) or (N, 1) float32 -> (N, 2) uint8, little-endian float16 (round to nearest even, as ggml's conversion)."""
    return t.half().view(torch.uint8).reshape(-1, 2)


# ---------------------------------------------------------------------------------------------- Q4_K


def make_qkx2_quants(x: torch.Tensor, weights: torch.Tensor, nmax: int, rmin: float, rdelta: float,
                     nstep: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The affine search for each sub-block: codes 0..nmax with ``x ~ scale * L - the_min``.

    Candidates: ``iscale = (nmax + rmin + rdelta * k) / (max - min)`` for k = 0..nstep, each followed by the
    weighted least-squares scale and min of the codes it gives (the min kept <= 0); the lowest weighted squared
    error wins. Later candidates use the range of the best fit so far, as the reference does.

    Args:
        x, weights: (M, n) float32 (M sub-blocks).

    Returns:
        (scale (M,), the_min (M,) >= 0, L (M, n) int32 codes).
    """
    mn = x.amin(1).clamp(max=0.0)  # the range always includes 0
    mx = x.amax(1)
    sum_w = _sum(weights, first=True)
    sum_x = _sum(weights * x, first=True)
    flat = mx == mn

    def codes(iscale, lo):  # (M,) scale inverse, (M,) min -> (M, n) codes
        return nearest_int(iscale[:, None] * (x - lo[:, None])).clamp(0, nmax)

    def error(scale, lo, L):  # weighted squared error of scale * L + lo against x
        diff = scale[:, None] * L.float() + lo[:, None] - x
        return _sum(weights * (diff * diff))

    iscale = _f32(nmax) / (mx - mn)
    scale = _f32(1.0) / iscale
    L = codes(iscale, mn)
    best = error(scale, mn, L)
    for k in range(nstep + 1):
        iscale = _f32(np.float32(rmin) + np.float32(rdelta) * np.float32(k) + np.float32(nmax)) / (mx - mn)
        La = codes(iscale, mn)
        lf = La.float()
        wl = weights * lf
        sum_l, sum_l2, sum_xl = _sum(wl), _sum(wl * lf), _sum(wl * x)
        D = sum_w * sum_l2 - sum_l * sum_l
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
        positive = this_min > 0  # a positive min is not allowed: fit the scale alone through 0
        this_scale = torch.where(positive, sum_xl / sum_l2, this_scale)
        this_min = torch.where(positive, torch.zeros_like(this_min), this_min)
        cur = error(this_scale, this_min, La)
        better = (D > 0) & (cur < best) & ~flat
        L = torch.where(better[:, None], La, L)
        best = torch.where(better, cur, best)
        scale = torch.where(better, this_scale, scale)
        mn = torch.where(better, this_min, mn)
    scale = torch.where(flat, torch.zeros_like(scale), scale)
    L = torch.where(flat[:, None], torch.zeros_like(L), L)
    return scale, -mn, L


def pack_q4_k_scales(ls: torch.Tensor, lm: torch.Tensor) -> torch.Tensor:
    """6-bit scales and mins (N, 8) each -> the 12 bytes (N, 12) of ``gguf_blocks.q4_k_scales``."""
    lo = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)  # low 6 bits of sc[0..3], high 2 bits of sc[4..7]
    mid = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)  # the same for the mins
    hi = (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)  # low nibbles of sc[4..7] and m[4..7]
    return torch.cat([lo, mid, hi], dim=1).to(torch.uint8)


def quantize_q4_k(x: torch.Tensor) -> np.ndarray:
    """Q4_K bytes of x (..., n) float, n a multiple of 256 -> uint8 (..., n / 256 * 144).

    Raises:
        ValueError: the last dimension is not a multiple of 256.
    """
    shape = tuple(torch.as_tensor(x).shape)
    xb = blocks_of(x, QK_K)  # (N, 256)
    n = xb.shape[0]
    xs = xb.reshape(n * 8, 32)  # (N * 8 sub-blocks, 32)
    av_x = _sqrt(_sum(xs * xs) / 32)
    scales, mins, L = make_qkx2_quants(xs, av_x[:, None] + xs.abs(), 15, -1.0, 0.1, 20)
    scales, mins, L = scales.reshape(n, 8), mins.reshape(n, 8), L.reshape(n, 8, 32)
    max_scale, max_min = scales.amax(1).clamp(min=0.0), mins.amax(1).clamp(min=0.0)
    zero = torch.zeros_like(max_scale)
    inv_scale = torch.where(max_scale > 0, _f32(63.0) / max_scale, zero)
    inv_min = torch.where(max_min > 0, _f32(63.0) / max_min, zero)
    # C stores nearest_int's int in a uint8 (mod 256) before taking MIN(63, .)
    ls = (nearest_int(inv_scale[:, None] * scales) & 0xFF).clamp(max=63)
    lm = (nearest_int(inv_min[:, None] * mins) & 0xFF).clamp(max=63)
    d, dmin = (max_scale / 63.0).half(), (max_min / 63.0).half()
    dl = d.float()[:, None] * ls.float()  # (N, 8): each sub-block's scale as the file stores it
    ml = dmin.float()[:, None] * lm.float()
    q = nearest_int((xb.reshape(n, 8, 32) + ml[:, :, None]) / dl[:, :, None]).clamp(0, 15)
    L = torch.where(dl[:, :, None] == 0, L, q)  # a zero scale keeps the search's codes, as the reference
    L = L.reshape(n, 4, 2, 32).to(torch.uint8)
    qs = (L[:, :, 0] | (L[:, :, 1] << 4)).reshape(n, 128)  # sub-block 2g low nibbles, 2g+1 high
    out = torch.cat([f16_bytes(d), f16_bytes(dmin), pack_q4_k_scales(ls, lm), qs], dim=1)
    return out.reshape(*shape[:-1], -1).numpy()


# ---------------------------------------------------------------------------------------------- Q6_K


def make_qx_quants(x: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The symmetric search for each sub-block: codes -nmax..nmax-1 with ``x ~ scale * l``.

    Candidates: ``iscale = -nmax / x[argmax |x|]`` and 18 neighbours ``-(nmax + 0.1 k) / max`` (k = -9..9,
    k != 0); each candidate's codes get the least-squares scale weighted by x^2, and the one that explains
    the most weighted energy (``sumlx^2 / suml2``) wins (ggml's rmse_type 1).

    Args:
        x: (M, n) float32 (M sub-blocks).

    Returns:
        (scale (M,), L (M, n) int32 codes l + nmax, 0..2 nmax - 1).
    """
    imax = x.abs().argmax(1, keepdim=True)  # the first largest |x|, as the C's strict >
    mx = x.gather(1, imax)[:, 0]
    zero = mx.abs() < _f32(GROUP_MAX_EPS)
    w = x * x

    def fit(iscale):
        l = nearest_int(iscale[:, None] * x).clamp(-nmax, nmax - 1)
        lf = l.float()
        return l, _sum(w * x * lf), _sum(w * lf * lf)

    l, sumlx, suml2 = fit(_f32(-nmax) / mx)
    L = l + nmax
    scale = torch.where(suml2 != 0, sumlx / suml2, torch.zeros_like(sumlx))
    best = scale * sumlx
    for k in range(-9, 10):
        if k == 0:
            continue
        l, sumlx, suml2 = fit(_f32(-(np.float32(nmax) + np.float32(0.1) * np.float32(k))) / mx)
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        L = torch.where(better[:, None], l + nmax, L)
        scale = torch.where(better, sumlx / suml2, scale)
        best = torch.where(better, scale * sumlx, best)
    scale = torch.where(zero, torch.zeros_like(scale), scale)
    L = torch.where(zero[:, None], torch.zeros_like(L), L)
    return scale, L


def quantize_q6_k(x: torch.Tensor) -> np.ndarray:
    """Q6_K bytes of x (..., n) float, n a multiple of 256 -> uint8 (..., n / 256 * 210).

    Raises:
        ValueError: the last dimension is not a multiple of 256.
    """
    shape = tuple(torch.as_tensor(x).shape)
    xb = blocks_of(x, QK_K)
    n = xb.shape[0]
    scales, L = make_qx_quants(xb.reshape(n * 16, 16), 32)
    scales, L = scales.reshape(n, 16), L.reshape(n, 16, 16)
    imax = scales.abs().argmax(1, keepdim=True)
    max_scale = scales.gather(1, imax)[:, 0]
    zero = max_scale.abs() < _f32(GROUP_MAX_EPS)  # an all-zero super-block is stored as zero bytes
    iscale = _f32(-128.0) / max_scale
    d = (_f32(1.0) / iscale).half()
    sc = nearest_int(iscale[:, None] * scales).clamp(max=127)  # (N, 16) int8 codes of the sub-block scales
    dl = d.float()[:, None] * sc.float()
    q = nearest_int(xb.reshape(n, 16, 16) / dl[:, :, None]).clamp(-32, 31) + 32
    L = torch.where(dl[:, :, None] == 0, L, q).reshape(n, 2, 4, 32).to(torch.uint8)  # (N, half, k, l)
    ql = torch.cat([L[:, :, 0] & 0xF | (L[:, :, 2] & 0xF) << 4, L[:, :, 1] & 0xF | (L[:, :, 3] & 0xF) << 4], dim=2)
    qh = (L[:, :, 0] >> 4) | (L[:, :, 1] >> 4) << 2 | (L[:, :, 2] >> 4) << 4 | (L[:, :, 3] >> 4) << 6
    sc8 = sc.to(torch.int8).view(torch.uint8)
    out = torch.cat([ql.reshape(n, 128), qh.reshape(n, 64), sc8, f16_bytes(d)], dim=1)
    out[zero] = 0
    return out.reshape(*shape[:-1], -1).numpy()


# ------------------------------------------------------------------- the per-block loops (baselines)


def _nint(f) -> int:
    """``nearest_int`` of one float32."""
    with np.errstate(over="ignore", invalid="ignore"):
        v = np.float32(f) + np.float32(12582912.0)
    return (int(np.array(v, dtype=np.float32).view(np.int32)) & 0x7FFFFF) - 0x400000


def _f16(v) -> tuple[np.float32, bytes]:
    h = np.float16(v)
    return np.float32(h), h.tobytes()


def _qkx2_naive(x, w, nmax, rmin, rdelta, nstep):
    f = np.float32
    n = len(x)
    lo, hi = min(x), max(x)
    sum_w, sum_x = w[0], w[0] * x[0]
    for i in range(1, n):
        sum_w, sum_x = sum_w + w[i], sum_x + w[i] * x[i]
    lo = min(lo, f(0))
    if hi == lo:
        return f(0), -lo, [0] * n
    iscale = f(nmax) / (hi - lo)
    scale = f(1) / iscale
    L = [max(0, min(nmax, _nint(iscale * (v - lo)))) for v in x]
    best = f(0)
    for i in range(n):
        diff = scale * f(L[i]) + lo - x[i]
        best = best + w[i] * (diff * diff)
    for k in range(nstep + 1):
        iscale = (f(rmin) + f(rdelta) * f(k) + f(nmax)) / (hi - lo)
        La = [max(0, min(nmax, _nint(iscale * (v - lo)))) for v in x]
        sum_l = sum_l2 = sum_xl = f(0)
        for i in range(n):
            wl = w[i] * f(La[i])
            sum_l, sum_l2, sum_xl = sum_l + wl, sum_l2 + wl * f(La[i]), sum_xl + wl * x[i]
        D = sum_w * sum_l2 - sum_l * sum_l
        if D > 0:
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            if this_min > 0:
                this_min, this_scale = f(0), sum_xl / sum_l2
            cur = f(0)
            for i in range(n):
                diff = this_scale * f(La[i]) + this_min - x[i]
                cur = cur + w[i] * (diff * diff)
            if cur < best:
                L, best, scale, lo = La, cur, this_scale, this_min
    return scale, -lo, L


def quantize_q4_k_naive(x: torch.Tensor) -> np.ndarray:
    """``quantize_q4_k`` one super-block and one weight at a time, in numpy float32 scalars."""
    f = np.float32
    shape = tuple(torch.as_tensor(x).shape)
    out = []
    for xb in blocks_of(x, QK_K).numpy():
        scales, mins, L = [], [], []
        for j in range(8):
            xs = [f(v) for v in xb[32 * j:32 * j + 32]]
            sum_x2 = f(0)
            for v in xs:
                sum_x2 = sum_x2 + v * v
            av_x = np.sqrt(sum_x2 / f(32))
            s, m, Lj = _qkx2_naive(xs, [av_x + abs(v) for v in xs], 15, -1.0, 0.1, 20)
            scales.append(s)
            mins.append(m)
            L += Lj
        max_scale, max_min = max([f(0)] + scales), max([f(0)] + mins)
        inv_scale = f(63) / max_scale if max_scale > 0 else f(0)
        inv_min = f(63) / max_min if max_min > 0 else f(0)
        ls = [min(63, _nint(inv_scale * s) & 0xFF) for s in scales]
        lm = [min(63, _nint(inv_min * m) & 0xFF) for m in mins]
        d, d_bytes = _f16(max_scale / f(63))
        dmin, dmin_bytes = _f16(max_min / f(63))
        for j in range(8):
            dl = d * f(ls[j])
            if dl == 0:
                continue
            ml = dmin * f(lm[j])
            for i in range(32):
                L[32 * j + i] = max(0, min(15, _nint((f(xb[32 * j + i]) + ml) / dl)))
        packed = [ls[k] | (ls[k + 4] >> 4) << 6 for k in range(4)] + [lm[k] | (lm[k + 4] >> 4) << 6 for k in range(4)]
        packed += [(ls[k + 4] & 0xF) | (lm[k + 4] & 0xF) << 4 for k in range(4)]
        qs = [L[64 * g + i] | L[64 * g + 32 + i] << 4 for g in range(4) for i in range(32)]
        out.append(np.frombuffer(d_bytes + dmin_bytes + bytes(packed) + bytes(qs), dtype=np.uint8))
    return np.stack(out).reshape(*shape[:-1], -1)


def _qx_naive(x, nmax):
    f = np.float32
    imax = max(range(len(x)), key=lambda i: (abs(x[i]), -i))  # the first largest |x|
    mx = x[imax]
    if abs(mx) < GROUP_MAX_EPS:
        return f(0), [0] * len(x)

    def fit(iscale):
        ls = [max(-nmax, min(nmax - 1, _nint(iscale * v))) for v in x]
        sumlx = suml2 = f(0)
        for v, l in zip(x, ls):
            w = v * v
            sumlx, suml2 = sumlx + w * v * f(l), suml2 + w * f(l) * f(l)
        return ls, sumlx, suml2

    ls, sumlx, suml2 = fit(f(-nmax) / mx)
    L = [l + nmax for l in ls]
    scale = sumlx / suml2 if suml2 != 0 else f(0)
    best = scale * sumlx
    for k in [k for k in range(-9, 10) if k]:
        ls, sumlx, suml2 = fit(-(f(nmax) + f(0.1) * f(k)) / mx)
        if suml2 > 0 and sumlx * sumlx > best * suml2:
            L, scale = [l + nmax for l in ls], sumlx / suml2
            best = scale * sumlx
    return scale, L


def quantize_q6_k_naive(x: torch.Tensor) -> np.ndarray:
    """``quantize_q6_k`` one super-block and one weight at a time, in numpy float32 scalars."""
    f = np.float32
    shape = tuple(torch.as_tensor(x).shape)
    out = []
    for xb in blocks_of(x, QK_K).numpy():
        scales, L = [], []
        for s in range(16):
            sc, Ls = _qx_naive([f(v) for v in xb[16 * s:16 * s + 16]], 32)
            scales.append(sc)
            L += Ls
        imax = max(range(16), key=lambda i: (abs(scales[i]), -i))
        if abs(scales[imax]) < GROUP_MAX_EPS:
            out.append(np.zeros(210, dtype=np.uint8))
            continue
        iscale = f(-128) / scales[imax]
        d, d_bytes = _f16(f(1) / iscale)
        sc = [min(127, _nint(iscale * s)) for s in scales]
        for s in range(16):
            dl = d * f(sc[s])
            if dl == 0:
                continue
            for i in range(16):
                L[16 * s + i] = max(-32, min(31, _nint(f(xb[16 * s + i]) / dl))) + 32
        ql, qh = [0] * 128, [0] * 64
        for h in range(2):
            a = L[128 * h:128 * h + 128]
            for i in range(32):
                ql[64 * h + i] = (a[i] & 0xF) | (a[i + 64] & 0xF) << 4
                ql[64 * h + 32 + i] = (a[i + 32] & 0xF) | (a[i + 96] & 0xF) << 4
                qh[32 * h + i] = a[i] >> 4 | (a[i + 32] >> 4) << 2 | (a[i + 64] >> 4) << 4 | (a[i + 96] >> 4) << 6
        block = bytes(ql) + bytes(qh) + np.array(sc, dtype=np.int8).tobytes() + d_bytes
        out.append(np.frombuffer(block, dtype=np.uint8))
    return np.stack(out).reshape(*shape[:-1], -1)


# ------------------------------------------------------------------------------------------ Q4_K_M


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's choice of the layers that get more bits: the first and last eighth, every third between."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


# for rows the block does not divide (llama.cpp's tensor_type_fallback): 256-weight blocks fall back to 32, then F16
FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q6_K: Q.Q8_0, Q.Q5_0: Q.F16, Q.Q8_0: Q.F16}
BLOCK_WEIGHTS = {Q.Q4_K: QK_K, Q.Q6_K: QK_K, Q.Q5_0: 32, Q.Q8_0: 32, Q.F16: 1}


def q4_k_m_types(tensors: list[tuple[str, tuple[int, ...]]], n_layers: int) -> dict[str, Q | None]:
    """The tensor types of llama.cpp's Q4_K_M recipe for a llama model.

    tensors: (GGUF name, shape in numpy order (rows, row length)) for every tensor, in file order.
    Returns {name: type}, None for tensors kept as they are (1-D norms). Follows
    ``llama_tensor_get_type`` for the llama architecture without an importance matrix: the
    per-category rule, then the fallback for a row length the block does not divide
    (``tensor_type_fallback``: Q4_K -> Q5_0, Q6_K -> Q8_0, and F16 where 32 does not divide the row
    either). One step goes past llama.cpp: an output layer whose rows 32 does not divide (Q8_0, which
    has no fallback there, so llama-quantize refuses the model) is F16 here too.
    """
    names = {name for name, _ in tensors}
    tied = "output.weight" not in names
    types = {}
    for name, shape in tensors:
        if len(shape) < 2 or not name.endswith("weight") or "_norm.weight" in name:
            types[name] = None
            continue
        row = shape[-1]
        layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
        qtype = Q.Q4_K
        if name == "output.weight" or (tied and name == "token_embd.weight"):
            qtype = Q.Q8_0 if row % QK_K else Q.Q6_K  # the output layer: Q6_K, or Q8_0 if 256 does not divide
        elif ("attn_v.weight" in name or "ffn_down" in name) and use_more_bits(layer, n_layers):
            qtype = Q.Q6_K
        while row % BLOCK_WEIGHTS[qtype]:  # F16's "block" of 1 divides every row
            qtype = FALLBACK[qtype]
        types[name] = qtype
    return types

"""End-to-end sensitivity of each linear layer to quantization: the measurement pass of variable bitrate
scored on the model's output instead of the block's.

``bitrate.measure`` scores an option by the error it leaves in its own block's output, which misses what
the error does downstream (the blocks after it can amplify or absorb it; notebook 05b measures how much
that matters). ``measure_logits`` quantizes one layer at a time, leaves every
other layer float, runs the rest of the model and records KL(float || quantized) of the next-token
distributions on calibration windows, in nats per token. For small perturbations these KL costs add up
across layers, so ``bitrate.optimize`` minimises their plain sum (power 1) under the bit budget.

The blocks before the quantized layer are float, so their output is computed once and each option only
reruns the model from the layer's block onward: ``measure_logits_naive`` (same signature) reruns the whole
model on a quantized copy, the baseline the tests compare it with. Notebook 05b's end-to-end rows (each
budget's allocation from this measurement, quantized and scored) are the lab's: ``minillm.lab.bitrate_rows``.
"""

from __future__ import annotations

import copy

import torch
from tqdm.auto import tqdm

from .bitrate import check_options, option_bits
from .pipeline import LAYERS, block_inputs, linear_of
from .qlinear import QuantLinear
from .rtn import QuantConfig, rtn_quantize

ERROR = "KL(float || quantized) of the next-token distributions, nats/token, one layer quantized, the rest float"


def _kl(ref_logp: torch.Tensor, logp: torch.Tensor) -> float:
    return (ref_logp.exp() * (ref_logp - logp)).sum(-1).mean().item()


def _tail(model, i: int, h: torch.Tensor, rope, mask) -> torch.Tensor:
    """Log-probabilities after running blocks ``i``.. of ``model`` on their input ``h``."""
    for j in range(i, len(model.layers)):
        h = model.layers[j](h, j, rope, None, mask)
    return torch.log_softmax(model.output(model.norm(h)).float(), dim=-1)


def _check(model, calib: torch.Tensor, options):
    options = check_options(options)
    if model.config.arch != "llama":
        raise ValueError(f"model: the sensitivity measurement supports the llama architecture, not {model.config.arch!r}")
    if calib.ndim != 2 or calib.shape[1] > model.config.max_seq_len:
        raise ValueError(f"calib: need (windows, tokens) ids with windows that fit the model's context of "
                         f"{model.config.max_seq_len}, got shape {tuple(calib.shape)}")
    return options


def _row(name: str, W: torch.Tensor, options, kls: list[float]) -> dict:
    return {"name": name, "out_features": W.shape[0], "in_features": W.shape[1],
            "bits": [option_bits(W.shape[0], W.shape[1], b, g) for b, g in options], "errors": kls}


def _table(options, layers: list[dict], calib: torch.Tensor) -> dict:
    return {"options": [list(o) for o in options], "layers": layers,
            "setup": {"method": "rtn", "error": ERROR, "end_to_end": True, "power": 1.0, "calib_samples": calib.shape[0],
                      "calib_seqlen": calib.shape[1]}}


@torch.no_grad()
def measure_logits(model, calib: torch.Tensor, options, *, progress: bool = True) -> dict:
    """Each (layer, option)'s KL cost on ``calib`` (N, T) ids, every layer quantized alone with round to
    nearest (``QuantConfig(bits, group_size)``; exact dequantize-and-matmul, so the cost is the rounding's).

    Returns a measurement table in ``bitrate.measure``'s layout (``options``, ``layers`` with ``name``,
    ``out_features``, ``in_features``, ``bits`` and ``errors`` = KL per option, ``setup`` with
    ``error`` = ``ERROR``); ``bitrate.optimize`` reads it.

    Raises:
        ValueError: bad options, windows past the context, or not a llama model.
    """
    options = _check(model, calib, options)
    X, rope, mask = block_inputs(model, calib.to(model.device))
    inputs = []
    for i, block in enumerate(model.layers):
        inputs.append(X)
        X = block(X, i, rope, None, mask)
    ref = _tail(model, len(model.layers), X, rope, mask)
    layers = []
    for i, block in enumerate(tqdm(model.layers, desc="measure (KL)", disable=not progress, leave=False)):
        for name in LAYERS:
            lin, parent, attr = linear_of(block, name)
            W = lin.weight.float()
            kls = []
            try:
                for bits, group in options:
                    setattr(parent, attr, QuantLinear(rtn_quantize(W, QuantConfig(bits, group)), lin.bias, fast=False))
                    kls.append(_kl(ref, _tail(model, i, inputs[i], rope, mask)))
            finally:
                setattr(parent, attr, lin)
            layers.append(_row(f"layers.{i}.{name}", W, options, kls))
    return _table(options, layers, calib)


@torch.no_grad()
def measure_logits_naive(model, calib: torch.Tensor, options, *, progress: bool = True) -> dict:
    """``measure_logits`` the direct way: for every (layer, option), a copy of the model with that layer
    quantized, run from the embedding to the logits."""
    options = _check(model, calib, options)
    X, rope, mask = block_inputs(model, calib.to(model.device))
    ref = _tail(model, 0, X, rope, mask)
    layers = []
    for i in tqdm(range(len(model.layers)), desc="measure (KL, naive)", disable=not progress, leave=False):
        for name in LAYERS:
            W = linear_of(model.layers[i], name)[0].weight.float()
            kls = []
            for bits, group in options:
                q = copy.deepcopy(model)
                lin, parent, attr = linear_of(q.layers[i], name)
                setattr(parent, attr, QuantLinear(rtn_quantize(W, QuantConfig(bits, group)), lin.bias, fast=False))
                kls.append(_kl(ref, _tail(q, 0, X, rope, mask)))
            layers.append(_row(f"layers.{i}.{name}", W, options, kls))
    return _table(options, layers, calib)

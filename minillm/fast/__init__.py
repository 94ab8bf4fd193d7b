"""The speed layer: what makes the library fast on one kind of machine, swapped in from outside.

The library (``minillm.model``, ``minillm.linear``, the caches, ``minillm.paged``, ``minillm.quant``) is plain torch,
read as the papers are. This package holds what a CPU needs on top, each piece with its library twin and a test that
they agree: minillm's C++ kernels (``kernels``), the linear layer laid out per core with a few-row kernel and oneDNN's
packed weights (``linear.FastLinear``), a layer's fused small operations (``layers``), the engine's fast reads of the
KV block pool (``paged``), the int4/int8 kernels of quantized layers (``quant``), the thread policy of a shared CPU
(``threads``) and the compiled decode step (``compiled``). The library never imports it (import-linter), except
``load_model(fast=True)``, which hands the model to ``accelerate``.

``accelerate(model)`` works as gpt-fast's module swap: each ``Linear`` becomes a ``FastLinear`` holding the same
weights, each ``QuantLinear`` and each norm, MLP, attention and block takes its speed-layer class (same state,
another ``forward``), and the engine's reads register, so ``LLM(model)`` serves it through "bucketed".
"""

from __future__ import annotations

import copy

from torch import nn

from ..linear import Linear
from ..model import Block, Decoder, RMSNorm
from ..quant.qlinear import QuantLinear
from .layers import TWINS, swap
from .linear import FastLinear
from .paged import register as register_paged_reads
from .quant import FastQuantLinear
from .threads import GOVERNOR, usable_cores

__all__ = ["accelerate", "plain_copy"]


def accelerate(model: Decoder, n_shards: int | None = None) -> Decoder:
    """Swap the speed layer into ``model`` in place; returns it. Calling it again changes nothing.

    Args:
        model: a ``Decoder`` (float or quantized, any device).
        n_shards: column blocks of each ``FastLinear``; default the cores this process may use on a CPU
            (``threads.usable_cores``), 1 elsewhere. On a CPU the threads are then fitted to the cores other
            processes leave free, and refitted every few seconds from the forwards (``threads.GOVERNOR``).

    Raises:
        TypeError: ``model`` is not a ``Decoder``.
    """
    if not isinstance(model, Decoder):
        raise TypeError(f"model: expected a minillm Decoder, got {type(model).__name__}")
    cpu = model.device.type == "cpu"
    n_shards = n_shards or (usable_cores() if cpu else 1)
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is Linear:
                setattr(module, name, FastLinear.from_linear(child, n_shards))
            elif type(child) is QuantLinear:
                swap(child, FastQuantLinear)
                if child.want_fast:
                    child.prepare_fast()  # minillm's kernels where the layout allows
        if type(module) in TWINS and not (type(module) is Block and not isinstance(module.ffn_norm, RMSNorm)):
            swap(module, TWINS[type(module)])  # a LayerNorm block (GPT-2) keeps its own order
    register_paged_reads()
    model.paged_backend = "bucketed"
    model.quant_linear_class = FastQuantLinear  # layers quantized from here on take minillm's kernels
    if cpu and not model.accelerated:
        GOVERNOR.fit()  # threads for the cores other processes leave free (a 0.1 s probe)
        model.register_forward_pre_hook(_tick)
    model.accelerated = True
    return model


def plain_copy(model: Decoder) -> Decoder:
    """A copy of ``model`` with every speed-layer module back to its library twin (the same weights): the plain
    model an accelerated one is measured and tested against. A plain model is copied as it is."""
    plain = copy.deepcopy(model)
    for module in list(plain.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, FastLinear):
                setattr(module, name, Linear(child.weight.detach(), None if child.bias is None else child.bias.detach()))
            elif type(child) is FastQuantLinear:
                child.__class__ = QuantLinear
                if child.want_fast:
                    child.prepare_fast()  # the library's kernels
        for library, fast in TWINS.items():
            if type(module) is fast:
                module.__class__ = library
    plain._forward_pre_hooks.clear()  # the governor's tick, the one hook accelerate registers
    plain.accelerated, plain.paged_backend, plain.quant_linear_class = False, "blockwise", None
    return plain


def _tick(module: nn.Module, args) -> None:
    GOVERNOR.tick()  # every few seconds: threads for the cores other processes leave free

"""Compiled decode: ``torch.compile`` over the decoder's layers for one-token steps.

Why: in eager PyTorch a batch-1 decode step of SmolLM2-135M is 121 matrix-vector products plus ~900
small operations (norms, RoPE, attention, cache writes, residual adds) of a few microseconds each
(notebook 01 measures both). ``torch.compile`` (Ansel et al. 2024, "PyTorch 2", ASPLOS) traces the step
into one graph; inductor fuses the elementwise operations into generated C++ (or Triton) loops,
``max_autotune`` times its own GEMM template against ATen's kernel for each weight shape and keeps the
faster, and ``freezing`` packs the weights once, as constants. On the CPU, attention over one query
becomes fused loops too (``minillm.fast.layers.attention_decode``). gpt-fast compiles its decode step the same
way; vLLM compiles its model and replays it with CUDA graphs, which minillm leaves out (docs/gpu.md).

Only one-token forwards (decode steps, B rows; also a one-token prompt) take the compiled path;
prefill and multi-token verification stay eager. The baseline is the same model uncompiled (tests
compare the two).
"""

from __future__ import annotations

import itertools
import types
import warnings

import torch

from ..linear import Linear
from ..model import Attention, Decoder
from .layers import FastAttention, swap
from .linear import FastLinear

# inductor's GEMM autotuning calls the deprecated Tensor.storage() inside torch itself; the warning says
# nothing a user of compiled decode can act on. Only inductor's own call is silenced: a user's stays.
warnings.filterwarnings("ignore", message="TypedStorage is deprecated", category=UserWarning,
                        module=r"torch\._inductor\.")

#: dynamo checks its guards before every step; those on the model's modules (every layer's attributes and
#: tensors) took about 0.9 ms of a 1-row step of the int4 model, 8% of its time (docs/decode.md). The weights
#: are frozen into the code anyway, so a change to them after compiling is already unseen: they are dropped,
#: and the guards on the step's own inputs (sizes, dtypes, the cache) stay
GUARDS = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
#: inductor settings: autotuned GEMMs over frozen (constant) weights; no CUDA graphs, because the
#: number of cached positions (a shape) changes every step
COMPILE_OPTIONS = {"max_autotune": True, "freezing": True, "triton.cudagraphs": False, **GUARDS}
#: on CUDA, without max_autotune: there it times Triton GEMM configurations for minutes (on an H200
#: it had not finished after 200 s), and a batch-1 decode step of this model on a GPU is bound by
#: kernel launches, not by its GEMMs (see ``compile_decode``)
CUDA_COMPILE_OPTIONS = {"freezing": True, "triton.cudagraphs": False, **GUARDS}
#: compiled versions kept per model (the weights' addresses are guarded; each batch size and cache
#: layout adds one)
RECOMPILE_LIMIT = 64


def compile_decode(model: Decoder, options: dict | None = None) -> Decoder:
    """Make ``model``'s one-token forwards run through ``torch.compile``; returns the same model.

    The first decode step compiles (minutes on a CPU, docs/roofline.md; inductor's disk cache speeds up later processes),
    the second again with the cached length as a symbolic size; later steps reuse the code until the batch size changes
    (at most ``RECOMPILE_LIMIT`` versions, then a step raises rather than run eager). The weights are frozen into the
    code (as much memory again): compile after their last change (``quantize_model`` drops a compiled decode).

    Args:
        model: a ``Decoder`` whose linear layers are ``Linear``, ``FastLinear`` or declare ``compilable``
            (``QuantLinear`` does: quantized layers compile too, docs/quant_methods.md). Its attention layers
            become ``FastAttention`` (one query per row attends through ``attention_decode`` when traced).
        options: inductor options (default ``COMPILE_OPTIONS``; ``CUDA_COMPILE_OPTIONS`` for a model
            on a GPU).

    Returns:
        ``model``, whose ``forward_layers`` now runs compiled for one-token forwards without gradients (an
        instance attribute over the class's method; those with gradients stay eager); logits agree with eager to
        float32 rounding.

    Raises:
        TypeError: ``model`` is not a ``Decoder``.
        ValueError: it holds linear layers that are neither ``Linear`` nor ``FastLinear`` nor declare ``compilable``.
    """
    if not isinstance(model, Decoder):
        raise TypeError(f"model: expected a minillm Decoder, got {type(model).__name__}")
    other = sorted({type(m).__name__ for m in model.modules()
                    if not isinstance(m, (Linear, FastLinear)) and hasattr(m, "in_features")
                    and not getattr(m, "compilable", False)})
    if other:
        raise ValueError(f"model: compile_decode supports minillm's Linear and FastLinear layers and layers that declare "
                         f"`compilable` (minillm.quant.QuantLinear); found {other}. Run this model without compiling")
    for m in model.modules():  # a layer may pick the kernel that inductor compiles best on this CPU
        if hasattr(m, "prepare_compile"):
            m.prepare_compile()
        if isinstance(m, Attention):
            swap(m, FastAttention)
    # dynamo keeps compiled versions per code object, and its "automatic dynamic" sizes per code name:
    # a renamed copy of the function for each model keeps another model's sizes (heads, widths) from
    # turning this one's into symbolic sizes; only the cached length becomes symbolic
    options = dict(options or (CUDA_COMPILE_OPTIONS if model.device.type == "cuda" else COMPILE_OPTIONS))
    compiled = torch.compile(_fresh_copy(_decode_layers, f"_decode_layers_{next(_COUNTER)}"), fullgraph=True,
                             options=options)

    # torch.compile reads inductor's ``freezing`` from the global config when it compiles (at the
    # first call), not from ``options``: set it for the call, not for the process; and keep the
    # autotuning tables out of the user's output
    settings = {"freezing": options.get("freezing", False),
                "autotune_num_choices_displayed": 0, "max_autotune_report_choices_stats": False}

    recompiles = {"recompile_limit": RECOMPILE_LIMIT, "fail_on_recompile_limit_hit": True}

    def forward_layers(x, rope, cache, mask, logits_indices=None):
        if x.shape[1] != 1 or torch.is_grad_enabled():  # prefill, verification, gradients: eager
            return Decoder.forward_layers(model, x, rope, cache, mask, logits_indices)
        with torch._inductor.config.patch(settings), torch._dynamo.config.patch(recompiles):
            logits = forward_layers.step(model, x, rope, cache, mask)
        # compiled without logits_indices (one graph whichever rows are wanted): every row is projected, then picked
        return logits if logits_indices is None else logits.flatten(0, 1)[logits_indices]

    forward_layers.step = compiled  # the compiled one-token step (an attribute: tests count its calls)
    model.forward_layers = forward_layers  # this model's own: copies and pickles drop it (Decoder.__getstate__)
    return model


def _decode_layers(model: Decoder, x, rope, cache, mask):
    return Decoder.forward_layers(model, x, rope, cache, mask)  # the class's method, not the instance's wrapper


def _fresh_copy(fn, name: str):
    """``fn`` with its own code object, renamed (same behaviour)."""
    code = fn.__code__.replace(co_name=name, co_qualname=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


_COUNTER = itertools.count()


def is_compiled(model: Decoder) -> bool:
    """Whether ``compile_decode`` has been applied to ``model`` (copies and quantized models are not)."""
    return model.compiled

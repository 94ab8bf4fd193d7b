"""How the speed layer's float32 linear layers read their weights: every linear layer of one decode step timed in
each weight layout (``measure_linear_layouts``, notebook 01), the same bytes read each time."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..fast import kernels
from ..fast.linear import _ONEDNN, FastLinear
from ..timing import time_median


@torch.inference_mode()
def measure_linear_layouts(model, batch_size: int = 1, repeats: int = 5) -> dict[str, float]:
    """Seconds to run every linear layer of one decode step (B rows) in each weight layout and through minillm's
    ``FastLinear`` itself. The same bytes are read in each; the difference is the kernel.

    Returns:
        {layout: seconds}, the layouts being

        * ``F.linear(x, W)`` with W (out, in) contiguous: PyTorch's default (``nn.Linear``, MKL);
        * ``x @ W^T`` with W^T (in, out) contiguous;
        * W^T split into one column block per core, one ``torch.bmm`` (``FastLinear`` for one row);
        * oneDNN's ``linear`` on W reordered into its blocked layout (``FastLinear`` for many rows), float32 on
          a CPU;
        * minillm's few-row kernel over the column blocks (``kernels.f32_linear``: W streamed once, in order;
          ``FastLinear`` for up to ``FEW_ROWS`` rows), float32 on a CPU where it is built;

        and "minillm FastLinear".
    """
    layers = [m for m in model.modules() if isinstance(m, FastLinear)]
    if not layers:
        raise ValueError("model: no FastLinear layers; time the layouts of a model loaded with fast=True "
                         "(minillm.fast.accelerate)")
    device = model.device
    xs = {n: torch.randn(batch_size, n, dtype=model.dtype, device=device) for n in {m.in_features for m in layers}}
    out = {}
    weights = [m.weight.contiguous() for m in layers]  # (out, in)
    out["F.linear(x, W), W (out, in)"] = time_median(
        lambda: [F.linear(xs[w.shape[1]], w) for w in weights], device, repeats)
    del weights
    weights_t = [m.weight.t().contiguous() for m in layers]  # (in, out)
    out["x @ W^T, W^T (in, out)"] = time_median(lambda: [xs[w.shape[0]] @ w for w in weights_t], device, repeats)
    del weights_t
    out[f"W^T in {layers[0].n_shards} column shards, bmm"] = time_median(
        lambda: [m.forward_shards(xs[m.in_features]) for m in layers], device, repeats)
    if device.type == "cpu" and model.dtype == torch.float32 and _ONEDNN:
        out["oneDNN linear, W packed (blocked)"] = time_median(
            lambda: [m.forward_onednn(xs[m.in_features], pad=False) for m in layers], device, repeats)
    if (device.type == "cpu" and model.dtype == torch.float32 and kernels.available()
            and all(m.weight_shards.shape[2] % kernels.TILE == 0 for m in layers)):
        out[f"W^T in {layers[0].n_shards} column shards, few-row kernel"] = time_median(
            lambda: [m.forward_few_rows(xs[m.in_features]) for m in layers], device, repeats)
    out["minillm FastLinear"] = time_median(lambda: [m(xs[m.in_features]) for m in layers], device, repeats)
    return out

"""Where a batch-1 decode step's time goes on a GPU: the kernels launched per step and the time the
GPU spends in them, against the step's wall time, eager and compiled (``minillm.compiled``).
Run by .ci/gpu-check; prints one JSON object."""

import json
import os
import time

import torch
from torch.profiler import ProfilerActivity, profile

from minillm import KVCache, load_model, roofline
from minillm.compiled import compile_decode
from minillm.generation import synchronize

DEVICE = os.environ.get("DEVICE", "cuda")  # DEVICE=cpu: a dry run of this script


@torch.inference_mode()
def step_profile(model, context=64, steps=16):
    t0 = time.perf_counter()
    roofline.measure_decode(model, 1, context, steps, repeats=1)  # warm-up (and, compiled, the compilations)
    warmup = time.perf_counter() - t0
    step_s = roofline.measure_decode(model, 1, context, steps)
    # the same steps under the profiler, in a cache of measure_decode's size (same shapes, no recompile)
    cache = KVCache(model.config, 1, context + steps + 1, model.dtype, model.device)
    tokens = torch.randint(100, 1000, (1, context), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    model(tokens, torch.arange(context, device=DEVICE), cache)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for i in range(steps):
            model(tokens[:, -1:], torch.tensor([context + i], device=DEVICE), cache)
        synchronize(DEVICE)
        wall = (time.perf_counter() - t0) / steps
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.time_range.elapsed_us() for e in kernels) / 1e6 / steps  # us -> s
    top = prof.key_averages().table(sort_by="self_device_time_total", row_limit=12)
    return {"warmup_s": warmup, "step_s": step_s, "step_s_profiled": wall,
            "kernels_per_step": len(kernels) / steps, "gpu_busy_s_per_step": busy,
            "gpu_busy_fraction": busy / wall}, top


model, _ = load_model(device=DEVICE)
out = {}
out["eager"], top_eager = step_profile(model)
out["compiled"], top_compiled = step_profile(compile_decode(model))
print(top_eager)
print(top_compiled)
print(json.dumps(out, indent=1))

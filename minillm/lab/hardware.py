"""The simulator's tables: accelerators (memory, bandwidth, matmul peak, the link between them, the per-step
overhead) and models by their config, each number with its source, plus this CPU as ``roofline`` measures it.

Datasheet numbers are what the vendor promises, dense (half the "with sparsity" figures); an engine reaches
less, which is why the CPU entry is built from measurements (``cpu_device``) and the simulation is checked
against measured runs before it predicts (docs/cluster.md). Where a number is an assumption, its source says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..config import ModelConfig

__all__ = ["DEVICES", "Device", "MODELS", "cpu_device", "device_named", "model_named"]

GB = 1e9


@dataclass(frozen=True)
class Device:
    """One accelerator as the cost model sees it.

    Attributes:
        name: the table's key.
        memory: bytes of device memory (None: the engine's default KV pool, as on this CPU).
        bandwidth: bytes/s of memory bandwidth; flops: FLOP/s of dense matmul in the model's dtype.
        link_bandwidth: bytes/s one device sends to its ring neighbour (one direction), for all-reduces.
        link_latency: seconds per hop of a collective (the latency x log2 p term).
        step_overhead: seconds every engine step costs beyond its bytes and FLOPs (launches, host work).
        dtype: the weights' and KV cache's dtype the peaks are for; sources: field -> where it comes from.
        flops_by_rows: ((rows, FLOP/s), ...) measured at a few matmul row counts, rows ascending (this CPU: a
            product of few rows runs far below the peak); empty: ``flops`` at every size.
    """

    name: str
    memory: float | None
    bandwidth: float
    flops: float
    link_bandwidth: float
    link_latency: float
    step_overhead: float
    dtype: str = "bfloat16"
    sources: dict[str, str] = field(default_factory=dict, compare=False)
    flops_by_rows: tuple = ()

    def __post_init__(self):
        for name in ("bandwidth", "flops", "link_bandwidth"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{self.name}: {name} must be positive, got {getattr(self, name)}")
        for name in ("link_latency", "step_overhead"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{self.name}: {name} must be >= 0 seconds, got {getattr(self, name)}")

    def flops_at(self, rows: int) -> float:
        """FLOP/s of a product of ``rows`` rows: ``flops_by_rows`` interpolated linearly in log2(rows) between
        its points and held at its ends; ``flops`` where it is empty."""
        points = self.flops_by_rows
        if not points:
            return self.flops
        if rows <= points[0][0]:
            return points[0][1]
        for (r0, f0), (r1, f1) in zip(points, points[1:]):
            if rows <= r1:
                w = math.log2(rows / r0) / math.log2(r1 / r0)
                return f0 + w * (f1 - f0)
        return points[-1][1]


# One CUDA-graph replay plus the engine's host work per step. Not measured here (no GPU is lent to this
# project's CPU runs); vLLM captures its decode step in CUDA graphs so that the host launches it once.
GRAPH_OVERHEAD = 1e-3
GRAPH_SOURCE = ("assumption: ~1 ms per step for a CUDA-graph engine (one replay, scheduling, sampling); "
                "minillm's eager step on the H200 cost 13.7 ms (docs/gpu.md), see EAGER_OVERHEAD_PER_LAYER")
#: minillm's eager decode on the H200 (docs/gpu.md): 72 tokens/s at batch 1 (13.9 ms a step) where the
#: roofline allows 7,308 (0.14 ms): 13.7 ms of launches for 30 layers, so ~0.46 ms per layer
EAGER_OVERHEAD_PER_LAYER = (1 / 72 - 1 / 7308) / 30
NVLINK_LATENCY = 5e-6
LATENCY_SOURCE = "assumption: ~5 us per ring hop (the order of NCCL's small-message all-reduce latency)"

DEVICES = {
    "h100": Device("H100 SXM", 80 * GB, 3.35e12, 989.5e12, 450 * GB, NVLINK_LATENCY, GRAPH_OVERHEAD, sources={
        "memory": "NVIDIA H100 Tensor Core GPU datasheet: 80 GB HBM3 (SXM5)",
        "bandwidth": "NVIDIA H100 datasheet: 3.35 TB/s (SXM5)",
        "flops": "NVIDIA H100 datasheet: BF16 1,979 TFLOPS with sparsity, 989.5 dense",
        "link_bandwidth": "NVIDIA H100 datasheet: NVLink 900 GB/s (both directions together), 450 one way",
        "link_latency": LATENCY_SOURCE, "step_overhead": GRAPH_SOURCE}),
    "h200": Device("H200", 141 * GB, 4.8e12, 989.5e12, 450 * GB, NVLINK_LATENCY, GRAPH_OVERHEAD, sources={
        "memory": "NVIDIA H200 Tensor Core GPU datasheet: 141 GB HBM3e (SXM)",
        "bandwidth": "NVIDIA H200 datasheet: 4.8 TB/s",
        "flops": "NVIDIA H200 datasheet: BF16 1,979 TFLOPS with sparsity, 989.5 dense",
        "link_bandwidth": "NVIDIA H200 datasheet: NVLink 900 GB/s (both directions), 450 one way",
        "link_latency": LATENCY_SOURCE, "step_overhead": GRAPH_SOURCE}),
    "a100": Device("A100 80GB SXM", 80 * GB, 2.039e12, 312e12, 300 * GB, NVLINK_LATENCY, GRAPH_OVERHEAD, sources={
        "memory": "NVIDIA A100 Tensor Core GPU datasheet: 80 GB HBM2e (SXM)",
        "bandwidth": "NVIDIA A100 datasheet: 2,039 GB/s (80GB SXM)",
        "flops": "NVIDIA A100 datasheet: BF16 312 TFLOPS dense (624 with sparsity)",
        "link_bandwidth": "NVIDIA A100 datasheet: NVLink 600 GB/s (both directions), 300 one way",
        "link_latency": LATENCY_SOURCE, "step_overhead": GRAPH_SOURCE}),
    "l4": Device("L4", 24 * GB, 300 * GB, 121e12, 32 * GB, 10e-6, GRAPH_OVERHEAD, sources={
        "memory": "NVIDIA L4 Tensor Core GPU datasheet: 24 GB GDDR6",
        "bandwidth": "NVIDIA L4 datasheet: 300 GB/s",
        "flops": "NVIDIA L4 datasheet: BF16 242 TFLOPS with sparsity, 121 dense",
        "link_bandwidth": "NVIDIA L4 datasheet: PCIe Gen4 x16, 64 GB/s (both directions), 32 one way; no NVLink",
        "link_latency": "assumption: ~10 us per hop over PCIe", "step_overhead": GRAPH_SOURCE}),
    "mi300x": Device("MI300X", 192 * GB, 5.3e12, 1307.4e12, 448 * GB, NVLINK_LATENCY, GRAPH_OVERHEAD, sources={
        "memory": "AMD Instinct MI300X data sheet: 192 GB HBM3",
        "bandwidth": "AMD MI300X data sheet: 5.3 TB/s",
        "flops": "AMD MI300X data sheet: BF16 1,307.4 TFLOPS dense (2,614.9 with sparsity)",
        "link_bandwidth": "AMD MI300X data sheet: 7 Infinity Fabric links of 128 GB/s (both directions) to the "
                          "other 7 GPUs; assumption: a collective uses all 7 at 64 GB/s one way, 448 GB/s",
        "link_latency": LATENCY_SOURCE, "step_overhead": GRAPH_SOURCE + " (ROCm graphs, HIP)"}),
}

#: the course's model and the two a student meets next, by config (their config.json on the Hugging Face hub)
MODELS = {
    "smollm2-135m": (ModelConfig(), "HuggingFaceTB/SmolLM2-135M-Instruct config.json (minillm's embedded model)"),
    "llama-3.1-8b": (ModelConfig(n_layers=32, dim=4096, n_heads=32, n_kv_heads=8, head_dim=128, ffn_dim=14336,
                                 vocab_size=128256, max_seq_len=131072, rope_base=500000.0, tie_embeddings=False),
                     "meta-llama/Llama-3.1-8B config.json: 32 layers, hidden 4096, 32 heads, 8 KV heads, "
                     "intermediate 14336, vocab 128256"),
    "llama-3.1-70b": (ModelConfig(n_layers=80, dim=8192, n_heads=64, n_kv_heads=8, head_dim=128, ffn_dim=28672,
                                  vocab_size=128256, max_seq_len=131072, rope_base=500000.0, tie_embeddings=False),
                      "meta-llama/Llama-3.1-70B config.json: 80 layers, hidden 8192, 64 heads, 8 KV heads, "
                      "intermediate 28672, vocab 128256"),
}


def device_named(name: str) -> Device:
    """The table's device (case and spaces ignored: "H100", "h100 sxm").

    Raises:
        ValueError: an unknown name (the message lists the table and says how to get "cpu").
    """
    key = name.lower().replace(" ", "").replace("sxm", "").replace("80gb", "")
    if key not in DEVICES:
        raise ValueError(f"--simulate: {name!r} is not in the hardware table; use one of {sorted(DEVICES)}, "
                         "or 'cpu' for this machine as roofline measures it")
    return DEVICES[key]


def model_named(name: str) -> ModelConfig:
    """The table's model config. Raises ValueError naming the choices."""
    if name.lower() not in MODELS:
        raise ValueError(f"--sim-model: {name!r} is not in the model table; use one of {sorted(MODELS)}")
    return MODELS[name.lower()][0]


def cpu_device(roofline: dict, name: str = "this CPU") -> Device:
    """This CPU from ``python -m minillm roofline --json``'s report (float32, its default rows: decode at batch 1
    and 8, prefill of 128): its measured streaming bandwidth; the overhead is what its batch-1 decode took beyond
    the bandwidth's bound; the matmul throughput at 8 rows what its batch-8 decode took beyond the overhead, at
    T rows what its prefill took (both from that report's rows, never from a serving run). No device memory: the
    simulation takes the engine's default KV pool.

    Raises:
        ValueError: a report without a float32 decode row at batch 1 and a prefill row.
    """
    rows = [r for r in roofline.get("rows", []) if r.get("dtype") == "float32"]
    decode = {r["batch_size"]: r for r in rows if r["kind"] == "decode"}
    prefill = max((r for r in rows if r["kind"] == "prefill"), key=lambda r: r["tokens"], default=None)
    if 1 not in decode or prefill is None:
        raise ValueError("roofline: the report needs a float32 decode row at batch 1 and a prefill row; run "
                         "python -m minillm roofline --batch-sizes 1,8 --prompt-lengths 128 --json")
    bandwidth = roofline["bandwidth"]
    overhead = max(0.0, decode[1]["measured_s"] - decode[1]["bytes"] / bandwidth)
    flops = prefill["flops"] / max(prefill["measured_s"] - overhead, 1e-9)
    by_rows = tuple((b, decode[b]["flops"] / max(decode[b]["measured_s"] - overhead, 1e-9))
                    for b in sorted(decode) if 1 < b < prefill["tokens"]) + ((prefill["tokens"], flops),)
    when = f"python -m minillm roofline on {roofline.get('machine', 'this machine')}"
    return Device(name, None, bandwidth, flops, 1e12, 0.0, overhead, dtype="float32", flops_by_rows=by_rows, sources={
        "bandwidth": f"{when}: streaming bandwidth {bandwidth / GB:.1f} GB/s",
        "flops": f"{when}: " + ", ".join(f"{f / 1e9:.1f} GFLOP/s at {r} rows" for r, f in by_rows)
                 + " (decode B and prefill T rows, each time less the overhead)",
        "step_overhead": f"{when}: decode B=1 took {decode[1]['measured_s'] * 1e3:.1f} ms, "
                         f"{overhead * 1e3:.1f} ms beyond its bytes / bandwidth",
        "memory": "the engine's default KV pool (minillm.paged.config.DEFAULT_KV_BYTES)",
        "link_bandwidth": "one CPU: no tensor parallelism", "link_latency": "one CPU"})

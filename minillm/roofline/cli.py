"""``python -m minillm roofline``: measured ceilings, the ridge point, predicted vs measured."""

from __future__ import annotations

from tqdm.auto import tqdm

from ..fast.compiled import compile_decode
from ..kv_cache import kv_cache_bytes
from ..options import add_model_args, int_list, load, print_json
from ..timing import available_memory, check_fits, machine, measure_decode
from .ceilings import compare, measure


def forward_bytes(model, rows: int, positions: int) -> float:
    """Bytes one measured forward needs beyond the weights, estimated: its KV cache, and per row
    (B x T) a few float32 copies of the logits (V) and of the widest activations (F, C)."""
    c = model.config
    kv = kv_cache_bytes(c, rows if positions == 1 else 1, positions, model.dtype.itemsize)
    return kv + 4 * rows * (c.vocab_size + 2 * c.ffn_dim + 4 * c.dim) * 4


def check_memory(model, batch_sizes, prompt_lengths, context: int = 64, steps: int = 16) -> None:
    """Refuse, before the ceilings are measured, a batch or length whose forward cannot fit in memory."""
    free = available_memory()
    if free is None:
        return
    needs = [("--batch-sizes", b, forward_bytes(model, b, context + steps + 1)) for b in batch_sizes]
    needs += [("--prompt-lengths", t, forward_bytes(model, t, t)) for t in prompt_lengths]
    for option, value, nbytes in needs:
        if nbytes > 0.8 * free:
            raise ValueError(f"{option}: {value} needs about {nbytes / 2**30:.1f} GiB of memory and "
                             f"{free / 2**30:.1f} GiB are free; measure a smaller one")


def cmd_roofline(args) -> int:
    model, _ = load(args)
    for t in args.prompt_lengths:  # before the minutes of measuring, not after
        check_fits(model, t, "--prompt-lengths")
    check_memory(model, args.batch_sizes, args.prompt_lengths)
    if args.compile:
        compile_decode(model)  # checks the model first
        # compile every batch size now, so that the ceilings below are measured seconds, not minutes,
        # before the decode steps they bound (this machine's bandwidth moves from minute to minute)
        for b in tqdm(args.batch_sizes, desc="compiling decode", disable=args.json, leave=False):
            measure_decode(model, b, repeats=1)  # the shapes compare() measures
    ceilings = measure(args.device)
    rows = compare(model, ceilings, args.batch_sizes, args.prompt_lengths, progress=not args.json)
    report = {"machine": machine(), "device": args.device, "copy_bandwidth": ceilings.copy_bandwidth,
              "read_bandwidth": ceilings.read_bandwidth, "bandwidth": ceilings.bandwidth,
              "matmul_flops": ceilings.matmul_flops,
              "ridge_point": {d: f / ceilings.bandwidth for d, f in ceilings.matmul_flops.items()}, "rows": rows}
    if args.json:
        print_json(report)
        return 0
    print(f"machine: {report['machine']}")
    print(f"memory: copy {ceilings.copy_bandwidth / 1e9:.1f} GB/s (read + write), streaming read "
          f"{ceilings.read_bandwidth / 1e9:.1f} GB/s")
    for d, f in ceilings.matmul_flops.items():
        print(f"matmul {d:9s}: {f / 1e9:8.1f} GFLOP/s (n={ceilings.matmul_size[d]}), "
              f"ridge point {f / ceilings.bandwidth:6.1f} FLOP/byte")
    print(f"{'':8s} {'B':>3s} {'T':>5s} {'FLOP/B':>7s} {'bound':>7s} {'predicted tok/s':>16s} {'measured tok/s':>15s} "
          f"{'measured/predicted time':>24s}")
    for r in rows:
        t = r["tokens"] // r["batch_size"]
        print(f"{r['kind'] + ('*' if r['compiled'] else ''):8s} {r['batch_size']:3d} {t:5d} {r['intensity']:7.1f} "
              f"{r['bound']:>7s} {r['predicted_tokens_per_s']:16.1f} {r['measured_tokens_per_s']:15.1f} "
              f"{r['measured_over_predicted']:24.2f}")
    if args.compile:
        print("* decode compiled with torch.compile (minillm.compiled)")
    return 0


def register(sub) -> None:
    r = sub.add_parser("roofline", help="measured ceilings, ridge point, predicted vs measured decode tokens/s")
    r.add_argument("--batch-sizes", type=int_list(1, allow_empty=False), default=(1, 8),
                   help="decode batch sizes, comma-separated (refused when a forward would not fit in memory)")
    r.add_argument("--prompt-lengths", type=int_list(1), default=(128,),
                   help="prefill lengths, comma-separated ('' for none)")
    r.add_argument("--compile", action="store_true",
                   help="decode through torch.compile (minillm.compiled; compiling takes 1-2 minutes on 2 cores)")
    add_model_args(r)
    r.set_defaults(func=cmd_roofline, measures_speed=True)

"""bench products: every linear layer of a forward, timed per row count and per kernel.

A decode step (1 row), a speculative verification (k + 1 rows) and an engine step (a few to a few dozen rows) run
the same weights through different kernels, and which one streams them fastest depends on the rows and on the
CPU. Per row count, the float32 model's ``Linear`` layers (the output layer included) through: the column shards
(one ``torch.bmm``), oneDNN's packed copy, minillm's few-row kernel (``kernels.f32_linear`` in blocks and in tiles,
16 and 8 lanes where the CPU has AVX-512) and what ``Linear`` chooses; with ``--quant-file``, the quantized model's
layers through minillm's int4 kernel in 16 and 8 lanes and as ``QuantLinear`` chooses. Each figure is the median of
repeated passes over every layer in turn, as a forward runs them (so each weight comes from memory, not from cache).
"""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

from ..fast import kernels
from ..fast.linear import _ONEDNN, FEW_ROWS, KERNEL_TILES, FastLinear
from ..loading import load_model
from ..options import print_json
from ..quant.qlinear import QuantLinear
from ..timing import machine, time_median


def _biased(m, y: torch.Tensor) -> torch.Tensor:
    """y plus the layer's bias, as the layer's own forward adds it after a kernel."""
    return y if m.bias is None else y + m.bias.to(y.dtype)


def _float_paths(layers: list[FastLinear]) -> dict:
    """name -> fn(layer, x) for the float32 layers, those this machine and these widths allow."""
    paths = {"shards, bmm": lambda m, x: m.forward_shards(x)}
    if _ONEDNN:
        paths["oneDNN, packed"] = lambda m, x: m.forward_onednn(x, pad=False)  # Linear's choice pads (ONEDNN_PADDING)
    if kernels.available() and all(m.weight_shards.shape[2] % kernels.TILE == 0 for m in layers):
        for lanes in ([16, 8] if torch.backends.cpu.get_cpu_capability() == "AVX512" else [8]):
            paths[f"few-row kernel, {lanes} lanes"] = lambda m, x, n=lanes: _biased(
                m, kernels.f32_linear(x, m.weight_shards, n))
            paths[f"few-row kernel, {lanes} lanes, tiles"] = lambda m, x, n=lanes: _biased(
                m, kernels.f32_linear(x, m.weight_shards, n, tiles=True))
    paths["Linear (its choice)"] = lambda m, x: m(x)
    return paths


def _int4_paths(layers: list[QuantLinear]) -> dict:
    """name -> fn(layer, x) for the quantized layers: minillm's int4 kernel per lane count (other layers, such as
    an int8 output layer, as they are), and ``QuantLinear`` itself."""
    def lanes_of(n):
        def run(m, x):
            kind, *t = m._kernel or (None,)
            if kind != "minillm-int4":
                return m(x)
            panels, s, z, kg, perm = t
            return _biased(m, kernels.int4_linear(x if perm is None else x[:, perm], panels, s, z, kg, lanes=n))
        return run
    paths = {}
    if kernels.available() and any((m._kernel or (None,))[0] == "minillm-int4" for m in layers):
        for n in ([16, 8] if torch.backends.cpu.get_cpu_capability() == "AVX512" else [8]):
            paths[f"int4 kernel, {n} lanes"] = lanes_of(n)
    paths["QuantLinear (its choice)"] = lambda m, x: m(x)
    return paths


def _check(paths: dict, layers, xs: dict, name: str, rows: int) -> None:
    """Every path computes its layers' product (against ``F.linear`` on the layer's float32 weight): a timing of
    a kernel that returns something else means nothing."""
    for m in layers:
        x = xs[m.in_features]
        ref = x @ m.weight.float().t() + (0 if m.bias is None else m.bias.float())
        tol = 1e-4 * (x.abs() @ m.weight.float().abs().t()).max().item() + 1e-6
        for p, f in paths.items():
            err = (f(m, x) - ref).abs().max().item()
            if not err <= tol:
                raise ValueError(f"{name} path {p!r} at {rows} rows: its product differs from F.linear by {err:.3g} "
                                 f"(tolerance {tol:.3g}); this is a bug, please report it")


def _weight_bytes(layers) -> int:
    return sum(m.weight_shards.numel() * 4 if isinstance(m, FastLinear) else m.kernel_nbytes() for m in layers)


@torch.inference_mode()
def measure_products(model, rows=(1, 2, 4, 8, 16, 32, 64), qmodel=None, repeats: int = 5, progress: bool = True) -> dict:
    """Seconds of every linear layer of ``model`` (and of ``qmodel``) at each row count, per kernel.

    Returns {"rows": [{"rows": r, "float32": {path: s}, "int4": {path: s}}], "weight_bytes": {...}, "few_rows":
    FEW_ROWS, "kernel_tiles": KERNEL_TILES, "machine": ...}.
    """
    fl = [m for m in model.modules() if isinstance(m, FastLinear)]
    ql = [m for m in qmodel.modules() if isinstance(m, QuantLinear)] if qmodel is not None else []
    sets = [("float32", fl, _float_paths(fl))] + ([("int4", ql, _int4_paths(ql))] if ql else [])
    g = torch.Generator().manual_seed(0)
    out = []
    for r in tqdm(rows, desc="rows", disable=not progress):
        row = {"rows": r}
        for name, layers, paths in sets:
            xs = {n: torch.randn(r, n, generator=g) for n in {m.in_features for m in layers}}
            _check(paths, layers, xs, name, r)
            row[name] = {p: time_median(lambda f=f: [f(m, xs[m.in_features]) for m in layers], "cpu", repeats, 1)
                         for p, f in paths.items()}
        out.append(row)
    return {"rows": out, "weight_bytes": {name: _weight_bytes(layers) for name, layers, _ in sets},
            "few_rows": FEW_ROWS, "kernel_tiles": KERNEL_TILES, "machine": machine()}


def format_products(report: dict) -> str:
    lines = []
    for name, nbytes in report["weight_bytes"].items():
        paths = list(report["rows"][0][name])
        lines.append(f"{name} layers ({nbytes / 1e6:.1f} MB): ms per pass over every layer (GB/s of the weights)")
        widths = [max(26, len(p)) for p in paths]  # a cell is 26 characters; a longer name widens its column
        lines.append(f"{'rows':>4}  " + "  ".join(f"{p:>{w}}" for p, w in zip(paths, widths)))
        for row in report["rows"]:
            cells = [f"{1e3 * s:8.1f} ({nbytes / s / 1e9:5.1f} GB/s)" for s in row[name].values()]
            lines.append(f"{row['rows']:>4}  " + "  ".join(f"{c:>{w}}" for c, w in zip(cells, widths)))
    order = "in tiles" if report["kernel_tiles"] else "in blocks"
    few = (f"Linear takes the few-row kernel up to {report['few_rows']} rows, {order}" if report["few_rows"]
           else "Linear takes one row through bmm, more through oneDNN")
    lines.append(f"{few}; {report['machine']}")
    return "\n".join(lines)


def cmd_bench_products(args) -> int:
    if args.dtype != "float32" or args.device != "cpu":
        raise ValueError(f"--dtype {args.dtype} --device {args.device}: bench products times the float32 CPU kernels "
                         "(and minillm's int4 ones); run it without --dtype and --device")
    model, _ = load_model(args.model, n_shards=args.shards)
    qmodel = load_model(args.quant_file)[0] if args.quant_file else None
    report = measure_products(model, args.rows, qmodel, args.repeats, progress=not args.json)
    print_json(report) if args.json else print(format_products(report))
    return 0


def register(bench) -> None:
    """Add ``products`` under ``bench``."""
    from ..options import add_model_args, at_least, int_list

    p = bench.add_parser("products", help="every linear layer per row count and per kernel (float32; int4 with "
                         "--quant-file): which kernel streams the weights fastest at a decode step's, a "
                         "verification's and an engine step's rows")
    add_model_args(p)
    p.add_argument("--rows", type=int_list(1, allow_empty=False), default=(1, 2, 4, 8, 16, 32, 64),
                   help="row counts, comma-separated (default 1,2,4,8,16,32,64)")
    p.add_argument("--quant-file", default=None, help="also a quantized model (a .safetensors written by `python -m "
                   "minillm quantize`)")
    p.add_argument("--repeats", type=at_least(1), default=5, help="passes per path and row count (the median; default 5)")
    p.set_defaults(func=cmd_bench_products, measures_speed=True)

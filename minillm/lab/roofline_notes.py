"""Notebook 01's and 01a's notes: the Markdown the roofline lessons show after they measure, and their records.

Like ``lesson_notes`` (which says why the wording lives outside the notebooks), one function per note, each
taking the measurements as the lesson holds them:

* 01: ``roofline_ranking``, ``layouts_note``, ``outside_linear_note``, ``waterfall_stages`` (the waterfall's
  bars), ``compiled_note``, ``roofline_record``, ``roofline_summary``;
* 01a: ``read_layout_verdict``, ``half_note``, ``gpu_line``, ``roofline_appendix_record``,
  ``roofline_appendix_summary``.
"""

from __future__ import annotations

import statistics


def _forward_name(r: dict) -> str:
    return f"decode B={r['batch_size']}" if r["kind"] == "decode" else f"prefill T={r['tokens']}"


def roofline_ranking(rows: list[dict]) -> str:
    """Notebook 01: the forwards ordered by measured / predicted time (``interleaved_compare``'s rows)."""
    ratio = {_forward_name(r): r["measured_over_predicted"] for r in rows}
    order = sorted(ratio, key=ratio.get)
    return (f"On this run the forward closest to its bound is **{order[0]}** (measured/predicted time "
            f"**{ratio[order[0]]:.2f}**), then {order[1]} ({ratio[order[1]]:.2f}) and {order[2]} ({ratio[order[2]]:.2f}); "
            f"the farthest is **{order[-1]}** (**{ratio[order[-1]]:.2f}**). Decode by batch size: "
            + ", ".join(f"B={r['batch_size']} {r['measured_over_predicted']:.2f}" for r in rows if r["kind"] == "decode") + ".")


OWN = "minillm FastLinear"  # measure_linear_layouts' name for the speed layer's own layer


def layouts_note(gbs: dict[int, dict[str, float]], ceiling_GBps: float, linear_bytes: float, rows: list[dict]) -> str:
    """Notebook 01: the weight layouts' GB/s per batch size (``gbs``) against the ceiling measured before them,
    and what batch 8's best layout means for the batch-8 bound (``rows``: the roofline's rows)."""
    ranked = {b: sorted(per, key=per.get, reverse=True) for b, per in gbs.items()}
    lines = [f"Against a ceiling of **{ceiling_GBps:.1f} GB/s** measured just before:", ""]
    for b, per in gbs.items():
        fast, slow = ranked[b][0], ranked[b][-1]
        above = [n for n in ranked[b] if per[n] > ceiling_GBps]
        lines.append(f"* batch {b}: fastest **{fast}** ({per[fast]:.1f} GB/s), slowest **{slow}** ({per[slow]:.1f}); "
                     f"minillm's `FastLinear` {per[OWN]:.1f} GB/s ({per[OWN] / per[fast]:.0%} of the "
                     "fastest); " + (f"above the ceiling: {', '.join(above)}." if above else "every layout below the ceiling."))
    onednn = next(n for n in gbs[1] if n.startswith("oneDNN"))
    b8 = next(r for r in rows if r["kind"] == "decode" and r["batch_size"] == 8)
    lin8 = linear_bytes / (gbs[8][ranked[8][0]] * 1e9)  # seconds for the linear layers at batch 8's best speed
    lines.append(f"* From batch 1 to batch 8, {onednn} went {gbs[1][onednn]:.1f} -> {gbs[8][onednn]:.1f} GB/s and the "
                 f"fastest layout {gbs[1][ranked[1][0]]:.1f} -> {gbs[8][ranked[8][0]]:.1f} GB/s. At batch 8's best speed "
                 f"the linear layers alone take {1e3 * lin8:.1f} ms, {lin8 / b8['predicted_s']:.2f}x the whole batch-8 bound "
                 f"(the batch-8 forward measured {b8['measured_over_predicted']:.2f}x it).")
    return "\n".join(lines)


def outside_linear_note(split: dict) -> str:
    """Notebook 01: the eager step against its linear layers alone (``lessons.step_outside_linear``)."""
    step_ms, linear_ms = (1e3 * statistics.median(split[k]) for k in ("step_s", "linear_s"))
    return (f"Timed back to back in each of {len(split['step_s'])} rounds (so both share the machine's minute): the eager "
            f"batch-1 step took **{step_ms:.1f} ms** (median), minillm's `Linear` layers alone **{linear_ms:.1f} ms**. "
            f"The rest, **{split['outside_share']:.0%} of the step** (median over the rounds), goes to the small operations "
            "between the products.")


def waterfall_stages(mid: dict) -> dict[str, float]:
    """Notebook 01's waterfall from its median round (``{"ceilings", "eager", "compiled", "weight_read"}``):
    {label: seconds}, the bound first, then the plain read, compiled and eager decode, fastest first."""
    read_s = mid["eager"]["bytes"] / mid["weight_read"]["bandwidth"]
    stages = {"plain read of the model's own weight tensors": read_s,
              "compiled decode": mid["compiled"]["measured_s"], "eager decode": mid["eager"]["measured_s"]}
    bound = f"bound: {mid['eager']['bytes'] / 1e6:.0f} MB at {mid['ceilings'].bandwidth / 1e9:.1f} GB/s"
    return {bound: mid["eager"]["predicted_s"], **dict(sorted(stages.items(), key=lambda kv: kv[1]))}


def compiled_note(mid: dict) -> str:
    """Notebook 01: compiled decode in its median round, against the bound and a plain read of the weights."""
    c, bound_s = mid["compiled"], mid["eager"]["predicted_s"]
    read_s = mid["eager"]["bytes"] / mid["weight_read"]["bandwidth"]
    gap_ms = 1e3 * (c["measured_s"] - bound_s)
    if c["measured_s"] < read_s:
        reading = (f"The compiled step is **faster** than that plain read (it takes {c['measured_s'] / read_s:.0%} of its "
                   "time): a tensor-by-tensor `sum` is not a floor for decode, only one way to stream the same tensors, "
                   f"and inductor's GEMM loops stream them faster. What separates compiled decode from the bound is its "
                   f"{gap_ms:.1f} ms.")
    else:
        reading = (f"The compiled step is slower than that plain read: of the {gap_ms:.1f} ms between compiled decode and "
                   f"the bound, {1e3 * (read_s - bound_s):.1f} ms are already in a plain read of the same tensors one by "
                   f"one, and {1e3 * (c['measured_s'] - read_s):.1f} ms in the kernels.")
    return (f"In the median round (ceiling **{mid['ceilings'].bandwidth / 1e9:.1f} GB/s**, measured right before it), "
            f"compiled decode took **{1e3 * c['measured_s']:.1f} ms** per token, **{1 / c['measured_over_predicted']:.0%}** "
            f"of the bound's speed (bound {1e3 * bound_s:.1f} ms), against **{1e3 * mid['eager']['measured_s']:.1f} ms** "
            f"eager. A plain `sum` over the model's own weight tensors needs {1e3 * read_s:.1f} ms for the same bytes "
            f"({bound_s / read_s:.0%} of the bound's speed). " + reading)


_ROOFLINE_KEEP = ("kind", "dtype", "batch_size", "tokens", "intensity", "bound", "predicted_s", "measured_s",
                  "predicted_tokens_per_s", "measured_tokens_per_s", "measured_over_predicted", "ratios",
                  "bandwidth_GB_per_s", "bandwidths_GB_per_s")


def roofline_record(machine: str, ceilings, rows: list[dict], gbs: dict, layout_ceiling_bw: float, mid: dict) -> dict:
    """Notebook 01's record (``figures/01_roofline.json``, which docs/roofline.md's table reads)."""
    bound_s = mid["eager"]["predicted_s"]
    read_s = mid["eager"]["bytes"] / mid["weight_read"]["bandwidth"]
    return {
        "machine": machine,
        "ceilings": {"read_GB_per_s": ceilings.read_bandwidth / 1e9, "copy_GB_per_s": ceilings.copy_bandwidth / 1e9,
                     "matmul_float32_GFLOP_per_s": ceilings.matmul_flops["float32"] / 1e9},
        "rows": [{k: r[k] for k in _ROOFLINE_KEEP if k in r} for r in rows],
        # linear_layouts_read_GB_per_s: that cell's ceiling, the larger of copy and read (the key's name is older)
        "linear_layouts_GB_per_s": gbs, "linear_layouts_read_GB_per_s": layout_ceiling_bw / 1e9,
        "compiled": {"read_GB_per_s": mid["ceilings"].bandwidth / 1e9, "bound_tokens_per_s": 1 / bound_s,
                     "weight_read_tokens_per_s": 1 / read_s, "compiled_tokens_per_s": mid["compiled"]["measured_tokens_per_s"],
                     "eager_tokens_per_s": mid["eager"]["measured_tokens_per_s"]},
    }


def _two_eager(eager_b1: dict, comp: dict) -> str:
    """The sentence that reconciles notebook 01's two figures for one eager batch-1 step: each is a ratio to the
    ceiling measured beside it, and the ceiling moves between cells."""
    first, second = 1 / eager_b1["measured_over_predicted"], comp["eager_tokens_per_s"] / comp["bound_tokens_per_s"]
    ceiling = abs(comp["read_GB_per_s"] / eager_b1["bandwidth_GB_per_s"] - 1)
    step = abs(comp["eager_tokens_per_s"] / eager_b1["measured_tokens_per_s"] - 1)
    moved = ("the ceiling moved more than the step did" if ceiling > step else
             "the step moved as much as the ceiling did (the machine's minute changed both)")
    return (f"Eager batch-1 decode appears twice: measured/predicted time {eager_b1['measured_over_predicted']:.2f}, "
            f"that is **{first:.0%}** of its bound's speed, against the {eager_b1['bandwidth_GB_per_s']:.1f} GB/s ceiling "
            f"of the first table, and **{second:.0%}** against the {comp['read_GB_per_s']:.1f} GB/s ceiling of the "
            f"compiled cell's round ({eager_b1['measured_tokens_per_s']:.1f} and {comp['eager_tokens_per_s']:.1f} "
            f"tokens/s): {moved} between the two cells, so each ratio is read beside the ceiling measured with it.")


def roofline_summary(rec: dict) -> str:
    """Notebook 01's closing note, from its record (``roofline_record``)."""
    rows, gbs, comp = rec["rows"], rec["linear_layouts_GB_per_s"], rec["compiled"]
    gbs = {int(b): per for b, per in gbs.items()}
    eager_b1 = next(r for r in rows if r["kind"] == "decode" and r["batch_size"] == 1)
    ratio = {_forward_name(r): r["measured_over_predicted"] for r in rows}
    order = sorted(ratio, key=ratio.get)
    ranked = {b: sorted(per, key=per.get, reverse=True) for b, per in gbs.items()}
    fast, slow = ranked[1][0], ranked[1][-1]
    batched = (f"At batch 8 the fastest layout streamed the weights at {gbs[8][ranked[8][0]]:.1f} GB/s against "
               f"{gbs[1][fast]:.1f} at batch 1: batched products stream more slowly than one row, so the bound, which "
               "assumes the ceiling, moves out of reach." if gbs[8][ranked[8][0]] < gbs[1][fast] else
               "Batched products streamed the weights as fast as one row here.")
    return f"""On this run ({rec['machine']}, float32):

* **Bandwidth ceiling {eager_b1['bandwidth_GB_per_s']:.1f} GB/s** right before batch-1 decode (median round), so its
  bound is **{eager_b1['predicted_tokens_per_s']:.1f} tokens/s**; eager, it ran at **{eager_b1['measured_tokens_per_s']:.1f}**
  (measured/predicted time **{eager_b1['measured_over_predicted']:.2f}**, the median of {len(eager_b1['ratios'])} rounds).
* Closest to its bound: **{order[0]}** ({ratio[order[0]]:.2f}); farthest: **{order[-1]}** ({ratio[order[-1]]:.2f}).
  {batched}
* The same weights, at batch 1: **{gbs[1][fast]:.1f} GB/s** through the fastest layout ({fast}) and
  **{gbs[1][slow]:.1f} GB/s** through the slowest ({slow}), against a {rec['linear_layouts_read_GB_per_s']:.1f} GB/s
  ceiling measured just before: the kernel, not the bytes, makes that difference.
* Compiled, batch-1 decode reached **{comp['compiled_tokens_per_s'] / comp['bound_tokens_per_s']:.0%} of the bound**
  ({comp['compiled_tokens_per_s']:.1f} against {comp['bound_tokens_per_s']:.1f} tokens/s, ceiling {comp['read_GB_per_s']:.1f}
  GB/s measured right before), eager {comp['eager_tokens_per_s'] / comp['bound_tokens_per_s']:.0%}.
* {_two_eager(eager_b1, comp)}

Decode is bound by the bytes it reads; how close it gets to that bound is decided by the kernels (and, here,
by compiling away the small operations between them), not by the FLOP/s the machine can do."""


def read_layout_verdict(layout_reads: dict[str, float]) -> str:
    """Notebook 01a: which reading the three reads of the same bytes support (``layout_reads``: the model's own
    tensors, views of one buffer, one sum; bytes/s, in that order)."""
    own_bw, views_bw, flat_bw = layout_reads.values()

    def same(a, b):
        return abs(a / b - 1) <= 0.10

    if same(views_bw, own_bw) and not same(flat_bw, views_bw) and flat_bw > views_bw:
        verdict = "the first reading: the views read like the model's tensors and one sum reads faster, so the cost is per operation"
    elif same(views_bw, flat_bw) and not same(own_bw, views_bw):
        verdict = "the second reading: the views read like the single sum, so it is where the model's tensors lie"
    elif same(own_bw, flat_bw) and same(views_bw, flat_bw):
        verdict = ("neither: all three reads lie within 10% of each other, so on this run neither the count of reads nor "
                   "where they lie costs much")
    else:
        verdict = ("neither cleanly: the three reads are " + ", ".join(f"{bw / 1e9:.1f}" for bw in layout_reads.values())
                   + " GB/s, an order that neither reading predicts; repeat the cell, minutes apart, before drawing a "
                   "conclusion")
    return f"This run supports **{verdict}**."


def half_note(half: dict, ceilings, native: list[str], isa: tuple[str, ...]) -> str:
    """Notebook 01a: float16 and bfloat16 decode against float32's and against their own bounds (``half``:
    {dtype: roofline row}); ``native``: the half-precision multiply-add flags this CPU lists of ``isa``."""
    lines = []
    for d in ("float16", "bfloat16"):
        r, f32 = half[d], half["float32"]
        mm = ceilings.matmul_flops[d] / ceilings.matmul_flops["float32"]
        line = (f"* **{d}**: large square products at **{mm:.2f}x** float32's FLOP/s; decode at "
                f"**{r['measured_tokens_per_s'] / f32['measured_tokens_per_s']:.2f}x** float32's speed, where the roofline "
                f"predicted {r['predicted_tokens_per_s'] / f32['predicted_tokens_per_s']:.2f}x ({r['bound']}-bound). ")
        if r["measured_over_predicted"] < 1:
            line += (f"It beat its bound (measured/predicted time {r['measured_over_predicted']:.2f}): the large-product "
                     "ceiling is not this dtype's peak for one-row products, which take another code path.")
        elif r["achieved_bandwidth"] < 0.5 * ceilings.bandwidth and r["achieved_flops"] < 0.5 * ceilings.matmul_flops[d]:
            line += (f"It streamed {r['achieved_bandwidth'] / 1e9:.1f} GB/s and did {r['achieved_flops'] / 1e9:.1f} GFLOP/s, "
                     "under half of both its bandwidth ceiling and its own matmul ceiling: neither limit of the roofline "
                     "explains it; the one-row kernel for this dtype does.")
        else:
            line += f"It ran at {1 / r['measured_over_predicted']:.0%} of its bound's speed."
        lines.append(line)
    if not native:
        lines.append("\nThis CPU lists none of " + ", ".join(isa) + ": it has no half-precision multiply-add, so every "
                     "kernel converts half-precision operands to float32 before multiplying (f16c, where listed, is such a "
                     "conversion, for float16 only), and how well a kernel hides that work behind the reads decides its "
                     "speed.")
    return "\n".join(lines)


def gpu_line(gpu: dict | None, elsewhere: dict) -> str:
    """Notebook 01a's answer to "what is the wall on a GPU?": this run's GPU row when it had one, else the
    record measured elsewhere (``lessons.gpu_record``), named as such."""
    if gpu:
        return f"* On the GPU, batch-1 decode reached **{1 / gpu['measured_over_predicted']:.1%}** of its bound."
    d = elsewhere["decode_B1"]
    return (f"* No GPU in this run. On {elsewhere['device']} (measured elsewhere: {elsewhere['source']}), batch-1 float32 "
            f"decode ran at **{d['measured_tokens_per_s']:,.0f} tokens/s** against a bound of "
            f"{d['predicted_tokens_per_s']:,.0f}: **{d['measured_tokens_per_s'] / d['predicted_tokens_per_s']:.1%} of the "
            "bound**. There the wall is the host launching one kernel per operation, not the memory.")


_HALF_KEEP = ("kind", "dtype", "batch_size", "tokens", "intensity", "bound", "predicted_s", "measured_s",
              "predicted_tokens_per_s", "measured_tokens_per_s", "measured_over_predicted")


def roofline_appendix_record(machine: str, half_ceilings, half: dict, shared: dict) -> dict:
    """Notebook 01a's record (``figures/01a_roofline_appendix.json``): the half-precision ceilings and rows, and
    the decode step's milliseconds beside a busy core (``shared``: {(busy, threads): ms})."""
    return {"machine": machine,
            "half_ceilings": {"read_GB_per_s": half_ceilings.read_bandwidth / 1e9,
                              "copy_GB_per_s": half_ceilings.copy_bandwidth / 1e9,
                              **{f"matmul_{d}_GFLOP_per_s": f / 1e9 for d, f in half_ceilings.matmul_flops.items()}},
            "half": {d: {k: r[k] for k in _HALF_KEEP} for d, r in half.items()},
            "shared_core_ms_per_step": {f"{'busy' if b else 'as is'}, {n} threads": ms for (b, n), ms in shared.items()}}


def roofline_appendix_summary(machine: str, reads: dict[int, list[float]], threads: int, ceiling_GBps: float,
                              n_tensors: int, layout_reads: dict[str, float], shared: dict, half: dict,
                              half_ceilings, gpu: dict | None, elsewhere: dict | None) -> str:
    """Notebook 01a's closing note: the read on one and on every thread (``reads``: {threads: [GB/s]}), the three
    reads of the same bytes, a busy core's cost, half precision, and the GPU's wall (``gpu_line``)."""
    own, views, flat = (bw / 1e9 for bw in layout_reads.values())
    return "\n".join([
        f"On this run ({machine}):", "",
        f"* The streaming read measured **{min(reads[1]):.1f}-{max(reads[1]):.1f} GB/s on one thread** and "
        f"**{min(reads[threads]):.1f}-{max(reads[threads]):.1f} GB/s on {threads}**: the second thread added "
        f"{max(reads[threads]) / max(reads[1]) - 1:+.0%} at best.",
        f"* Against a ceiling of **{ceiling_GBps:.1f} GB/s** measured right before: the model's {n_tensors} weight tensors "
        f"read one by one at **{own:.1f} GB/s**, the same bytes as views of one buffer at **{views:.1f} GB/s**, and in one "
        f"sum at **{flat:.1f} GB/s**.",
        f"* One decode step took **{shared[0, threads]:.1f} ms on {threads} threads** as the machine was and "
        f"**{shared[1, threads]:.1f} ms** with one CPU-bound process beside it (one thread: {shared[0, 1]:.1f} -> "
        f"{shared[1, 1]:.1f} ms).",
        f"* float16 decode ran at **{half['float16']['measured_tokens_per_s']:.1f} tokens/s** and bfloat16 at "
        f"**{half['bfloat16']['measured_tokens_per_s']:.1f}**, against {half['float32']['measured_tokens_per_s']:.1f} in "
        f"float32 (ceilings measured right before: {half_ceilings.bandwidth / 1e9:.1f} GB/s).",
        gpu_line(gpu, elsewhere)])

"""The README's and docs' result tables are rebuilt from the committed JSON (tools/tables: repository tooling,
run from the repository's root, outside the package)."""

import json
import re
from pathlib import Path

import pytest

from tools import tables
from tools.tables import decode as decode_tables
from tools.tables import paged as paged_tables

ROOT = Path(__file__).resolve().parent.parent  # the repository


def test_committed_tables_are_rebuilt_from_the_committed_json():
    # a table edited by hand, or JSON re-recorded without `python -m tools.tables`, shows up here
    assert tables.rebuild(ROOT, check=True) == [], "run `python -m tools.tables` and commit the result"


def test_every_file_holds_the_markers_of_its_tables():
    for rel, names in tables.FILES.items():
        text = (ROOT / rel).read_text(encoding="utf-8")
        found = [m["name"] for m in tables.MARKER.finditer(text)]
        assert found == names, rel
        assert set(names) <= set(tables.TABLES), rel


def _kv_report():
    return {"machine": "test machine", "positions": [32, 544], "prompt_tokens": 32, "new_tokens": 512,
            "step_ms": {"none": {"32": 70.0, "544": 1000.0}, "dynamic": {"32": 30.0, "544": 33.0},
                        "contiguous": {"32": 31.0, "544": 31.5}},
            "total_s": {"none": 250.0, "dynamic": 16.0, "contiguous": 12.5},
            "kv_kib_per_token": {"float32": 45.0, "float16": 22.5, "int8": 11.953125, "mha_float32": 135.0},
            "int8_step": {"position": 1032, "float32_ms": 40.0, "int8_ms": 50.0},
            "perplexity": {"play": "hamlet", "tokens": 4088, "seqlen": 512, "float32": 29.0, "int8": 29.29}}


def _row(kind, batch_size, tokens, predicted, measured, dtype="float32"):
    return {"kind": kind, "dtype": dtype, "batch_size": batch_size, "tokens": tokens, "intensity": 0.5 * tokens,
            "bound": "memory", "predicted_tokens_per_s": predicted, "measured_tokens_per_s": measured,
            "measured_over_predicted": predicted / measured}


def _roofline_report():
    return {"machine": "m", "ceilings": {"read_GB_per_s": 19.0, "copy_GB_per_s": 25.0, "matmul_float32_GFLOP_per_s": 350.0},
            "rows": [_row("decode", 1, 1, 50.0, 40.0), _row("prefill", 1, 64, 1000.0, 500.0)],
            "linear_layouts_GB_per_s": {"1": {"F.linear": 28.0, "shards": 25.0}, "8": {"F.linear": 11.0, "shards": 13.0}},
            "linear_layouts_read_GB_per_s": 26.0,
            "compiled": {"read_GB_per_s": 27.0, "bound_tokens_per_s": 50.0, "weight_read_tokens_per_s": 38.0,
                         "compiled_tokens_per_s": 45.0, "eager_tokens_per_s": 34.0},
            "half": {"float32": _row("decode", 1, 1, 50.0, 40.0), "float16": _row("decode", 1, 1, 4.0, 5.0, "float16")}}


def _tour_report():
    return {"machine": "m", "dtype": "float32", "prompt_tokens": 7, "new_tokens": 128, "rows": [
        {"technique": "KV cache (contiguous)", "baseline": "recompute the sequence every step",
         "baseline_tokens_per_s": 8.0, "tokens_per_s": 32.0, "speedup": 4.0, "check": "greedy tokens identical"}]}


def _bench_report():
    def path(tps, same=True):
        return {"decode_tokens_per_s": tps, "prefill_s": 0.05, "achieved_GB_per_s": tps * 0.5, "same_tokens_as_cached": same}
    return {"machine": "m", "device": "cpu", "dtype": "float32", "batch_size": 1, "prompt_tokens": 7, "new_tokens": 64,
            "repeats": 3, "weight_bytes": 500e6, "results": {
                "ours naive (no cache)": path(10.0), "ours cached (contiguous KV)": path(30.0),
                "ours paged KV (block_size 16)": path(28.5), "transformers (same GGUF)": path(15.0, False),
                "cached_over_transformers": 2.0}}


def _llamacpp_report():
    def path(runs, mb, equal, **extra):
        return {"decode_tokens_per_s": sorted(runs)[1], "runs": runs, "prefill_s": 0.1, "bytes_per_token": mb * 1e6,
                "achieved_GB_per_s": mb * sorted(runs)[1] / 1e3, "share_of_bound": mb * sorted(runs)[1] / 1e3 / 20,
                "tokens_equal_to_float": equal, **extra}
    return {"machine": "m", "device": "cpu", "threads": 2, "batch_size": 1, "prompt_tokens": 7, "new_tokens": 64,
            "repeats": 3, "bandwidth": {"before": 19e9, "after": 20e9, "ceiling": 20e9},
            "results": {"ours float32 (cached, eager)": path([30.0, 31.0, 32.0], 538.0, 64),
                        "ours int4 (RTN g64), float head": path([60.0, 62.0, 64.0], 173.0, 5),
                        "ours int4 (RTN g64), int8 head": path([70.0, 72.0, 74.0], 88.0, 5),
                        "ours int4 (RTN g64), int8 head, compiled": path([140.0, 144.0, 150.0], 88.0, 5,
                                                                          tokens_equal_to_eager=24),
                        "llama.cpp (same GGUF)": path([120.0, 120.0, 120.0], 96.6, 16)},
            "best_ours": "ours int4 (RTN g64), int8 head, compiled", "best_over_llamacpp": 1.2,
            "best_over_llamacpp_per_repeat": [1.1667, 1.2, 0.95]}


def _serve_report():
    def mode(out_tps, same):
        return {"wall_s": 100.0, "output_tokens": 5000, "total_tokens": 7500, "output_tokens_per_s": out_tps,
                "total_tokens_per_s": 1.5 * out_tps, "ttft_p50_s": 1.0, "ttft_p99_s": 2.0, "tpot_p50_s": 0.1,
                "tpot_p99_s": 0.2, "same_tokens_as_sequential": same}
    engine = {**mode(100.0, 64), "kv_utilization": 0.9, "preemptions": 0, "prefix_hit_rate": 0.0, "peak_blocks": 200,
              "mean_blocks": 100.0, "steps": 500, "lab_kv_utilization": 0.905, "num_blocks": 700}
    return {"machine": "m", "dtype": "float32", "trace": "sharegpt", "scale": 0.25, "num_requests": 64, "block_size": 16,
            "max_num_seqs": 64, "max_num_batched_tokens": 256, "mean_prompt": 39.0, "mean_output": 84.0,
            "modes": {"engine": engine, "static": mode(40.0, 64), "sequential": mode(20.0, 64),
                      "transformers": mode(50.0, 63)},
            "paper": {"kv_utilization": 0.963, "parallel_sampling_saved": "6.1-30.5%", "beam_search_saved": "37.6-66.3%"},
            "memory": {"trace": "sharegpt", "num_requests": 64, "mean_prompt": 160.0, "mean_output": 330.0,
                       "kv_utilization": 0.983, "lab_kv_utilization": 0.984},
            "sharing": {"width": 4, "num_requests": 8, "parallel_sampling": 0.16, "beam_search": 0.52},
            "goals": {"engine_vs_sequential": {"measured": 5.0, "goal": 4.0, "held": True},
                      "engine_vs_transformers": {"measured": 2.0, "goal": 3.0, "held": False},
                      "kv_utilization": {"measured": 0.983, "goal": 0.96, "held": True}}}


def _fragmentation_report():
    schemes = {"max": 0.25, "pow2": 0.44, "oracle": 0.59, "paged_1": 1.0, "paged_16": 0.985, "paged_256": 0.797}
    trace = {"schemes": schemes, "num_requests": 10000, "mean_prompt": 160.0, "mean_output": 330.0, "distribution": "d"}
    return {"traces": {"sharegpt": trace}, "paper": {"max": 0.204, "paged_16": 0.963},
            "paper_without_external": {"max": 0.224}, "max_seq_len": 2048, "block_sizes": [1, 16, 256],
            "measure": "time-averaged share"}


def _spec_report():
    def row(name, measured, predicted):
        return {"workload": name, "new_tokens": 48, "plain_tokens_per_s": 30.0, "spec_tokens_per_s": 30.0 * measured,
                "alpha": 0.95, "passes_without_draft": 0.08, "tokens_per_target_pass": 4.0, "leviathan_speedup": 4.5,
                "leviathan_speedup_with_verify_cost": 2.8, "predicted_speedup_alpha": 2.7, "predicted_speedup": predicted, "measured_speedup": measured,
                "same_tokens": True}
    sweep = [{"workload": "rewrite", "gamma": g, "measured_speedup": m, "predicted_speedup": p,
              "tokens_per_target_pass": t} for g, m, p, t in ((4, 2.6, 2.5, 4.0), (24, 7.9, 6.3, 12.0), (32, 7.5, 6.1, 12.0))]
    return {"machine": "m", "dtype": "float32", "proposer": "ngram", "num_speculative_tokens": 4, "new_tokens": 64,
            "verify_steps": {"1": 1.0, "5": 1.6, "17": 2.1}, "rows": [row("rewrite", 2.6, 2.5), row("story", 0.9, 1.0)],
            "sweep": {"gammas": [4, 24, 32], "repeats": 2, "rows": sweep, "best": {"rewrite": {"predicted": 24, "measured": 24}}}}


def _stack_report():
    def row(name, tps, weights="float32"):
        return {"name": name, "weights": weights, "output_tokens_per_s": tps, "ttft_p50_s": 1.0, "ttft_p99_s": 2.0,
                "tpot_p50_s": 0.05, "tpot_p99_s": 0.08, "weight_bytes": 5e8, "peak_kv_bytes": 1e7, "kl": 0.0,
                "top1_agreement": 1.0, "greedy_equal_share": 1.0, "bound_tokens_per_s": 40.0, "over_row2": tps / 10,
                "max_concurrency_at_tpot_slo": 4}
    sweep = {"1": {"output_tokens_per_s": 10.0, "tpot_p99_s": 0.1}, "4": {"output_tokens_per_s": 30.0, "tpot_p99_s": 0.2}}
    return {"machine": "m", "num_requests": 16, "copy_requests": 8, "mean_prompt": 90.0, "new_tokens": 32,
            "naive_requests": 2, "quant_recipe": "RTN g64", "quality_protocol": "hamlet", "bandwidth_GB_per_s": 18.0,
            "rows": [row("no KV cache", 2.0), row("KV cache", 10.0), row("paged engine", 50.0)],
            "gains": {"KV cache": {"alone": 5.0, "in_stack": 5.0}, "int4 weights": {"alone": 1.5, "in_stack": 1.1}},
            "sweep": {"paged engine": sweep}, "sweep_tokens": 16, "int4_over_float_engine": {"1": 1.5, "4": 1.2},
            "full_stack_over_row2": 5.0, "full_stack_over_row1": 25.0}


def _llamacpp_avx2_report():
    return {**_llamacpp_report(), "machine": "m (AVX2 by ATEN_CPU_CAPABILITY=avx2)", "llamacpp_build": "AVX AVX2 F16C FMA"}


REPORTS = {"02_kv_cache.json": _kv_report, "01_roofline.json": _roofline_report, "tour.json": _tour_report,
           "bench_decode.json": _bench_report, "bench_decode_llamacpp.json": _llamacpp_report,
           "bench_decode_llamacpp_avx2.json": _llamacpp_avx2_report, "serve_bench.json": _serve_report, "fragmentation.json": _fragmentation_report,
           "04_speculative.json": _spec_report, "stack.json": _stack_report}


def _write(folder, *names):
    for name in names or REPORTS:
        tables.record(REPORTS[name](), folder / name, f"cmd for {name}")


def test_kv_table_computes_its_ratios_and_states_its_source(tmp_path):
    tables.record(_kv_report(), tmp_path / "02_kv_cache.json", "jupyter nbconvert --execute notebooks/02_kv_cache.ipynb")
    text = decode_tables.kv_cache(tmp_path)
    assert "**20.0x**" in text  # 250 / 12.5
    assert "none 70.0 → 1000.0 ms" in text and "contiguous 31.0 → 31.5 ms" in text
    assert "(1.25x)" in text and "(+1.00%)" in text and "53% of float16" in text
    rec = json.loads((tmp_path / "02_kv_cache.json").read_text())
    assert f"`{rec['command']}`, {rec['date']}" in text  # the command and date that produced the JSON
    assert rec["load"] in text


def test_rebuild_text_replaces_only_between_markers(tmp_path):
    tables.record(_kv_report(), tmp_path / "02_kv_cache.json", "cmd")
    text = "before\n<!-- table:kv_cache -->\nold table\n<!-- /table -->\nafter\n"
    new = tables.rebuild_text(text, tmp_path)
    assert new.startswith("before\n<!-- table:kv_cache -->\n| notebook 02 |") and new.endswith("<!-- /table -->\nafter\n")
    assert "old table" not in new
    assert tables.rebuild_text(new, tmp_path) == new  # rebuilding twice changes nothing


def test_unknown_marker_and_missing_json_are_named(tmp_path):
    with pytest.raises(KeyError, match="table:nosuch"):
        tables.rebuild_text("<!-- table:nosuch -->\n<!-- /table -->", tmp_path, "README.md")
    with pytest.raises(FileNotFoundError, match="notebooks/02_kv_cache.ipynb writes it"):
        decode_tables.kv_cache(tmp_path)
    (tmp_path / "02_kv_cache.json").write_text('{"rows": []}')
    with pytest.raises(ValueError, match="not a record"):
        decode_tables.kv_cache(tmp_path)
    (tmp_path / "02_kv_cache.json").write_text('{"command": "c", "date": ')  # cut short
    with pytest.raises(ValueError, match="not valid JSON.*notebooks/02_kv_cache.ipynb"):
        decode_tables.kv_cache(tmp_path)
    tables.record({"machine": "m"}, tmp_path / "02_kv_cache.json", "cmd")  # a record from another version
    with pytest.raises(ValueError, match="table kv_cache: a record it reads lacks the key 'step_ms'.*02_kv_cache.ipynb"):
        tables.rebuild_text("<!-- table:kv_cache -->\n<!-- /table -->", tmp_path, "docs/kv_cache.md")


@pytest.mark.parametrize("name", sorted({n for names in tables.FILES.values() for n in names}))
def test_every_wired_table_names_the_command_that_writes_a_missing_or_invalid_record(tmp_path, name):
    _write(tmp_path)
    build = tables.TABLES[name]
    build(tmp_path)  # every record there: it builds
    needed = []
    for record in sorted(tables.WRITERS):
        if not (tmp_path / record).exists():
            continue
        good = (tmp_path / record).read_text()
        (tmp_path / record).unlink()
        try:
            build(tmp_path)
        except FileNotFoundError as e:  # a record this table reads: the error names what writes it
            assert tables.WRITERS[record] in str(e) and record in str(e)
            needed.append(record)
            (tmp_path / record).write_text('{"report": {}}')
            with pytest.raises(ValueError, match=re.escape(f"{record}: not a record") + ".*" + re.escape(tables.WRITERS[record])):
                build(tmp_path)
        (tmp_path / record).write_text(good)
    assert needed == sorted(tables.READS[name]), name  # READS names what to re-record for this table


def test_record_keeps_command_date_and_load(tmp_path):
    path = tables.record({"x": float("nan")}, tmp_path / "r.json", "python -m minillm tour --json")
    rec = json.loads(path.read_text())  # strict JSON: NaN became null
    assert rec["command"] == "python -m minillm tour --json" and rec["report"] == {"x": None}
    assert len(rec["date"]) == 10 and rec["date"][4] == "-" and rec["load"]


def test_headline_pairs_each_technique_with_its_baseline_from_one_run(tmp_path):
    _write(tmp_path, "tour.json", "bench_decode.json", "bench_decode_llamacpp.json", "serve_bench.json",
           "bench_decode_llamacpp_avx2.json")
    text = tables.headline(tmp_path)
    assert "| KV cache (contiguous) | recompute the sequence every step | 8.0 | 32.0 | 4.00x |" in text
    assert "| transformers on the same GGUF weights | 15.0 | 30.0 | 2.00x | tokens differ |" in text
    # llama.cpp: the medians, and the median of the per-repeat ratios as the speedup
    assert ("| int4 (RTN g64), int8 head, compiled | llama.cpp's Q4_1 on the same GGUF | 120.0 | 144.0 | 1.20x | "
            "first 5/64 greedy tokens equal float32's (llama.cpp: first 16) |") in text
    assert "| one request at a time | 20.0 | 100.0 | 5.00x |" in text
    assert "| static batches of 64 | 40.0 | 100.0 | 2.50x |" in text
    assert "| transformers' continuous batching | 50.0 | 100.0 | 2.00x | 64/64 requests' greedy tokens equal one at a time's (transformers: 63/64) |" in text
    for name in ("tour.json", "bench_decode.json", "bench_decode_llamacpp.json", "serve_bench.json"):
        assert f"`cmd for {name}`" in text
    assert "\nm, float32, greedy." in text  # one machine: named once, above the runs
    # the run held to AVX2 is a row of its own, and names its cap and llama.cpp's build whatever the other runs share
    assert ("| int4 (RTN g64), int8 head, compiled, AVX2 | llama.cpp's Q4_1 built for AVX2 | 120.0 | 144.0 | 1.20x |"
            in text)
    assert "llama.cpp built for AVX AVX2 F16C FMA; m (AVX2 by ATEN_CPU_CAPABILITY=avx2); `cmd for bench_decode_llamacpp_avx2.json`" in text


def test_headline_names_each_runs_machine_when_the_runs_differ(tmp_path):
    _write(tmp_path, "tour.json", "bench_decode.json", "bench_decode_llamacpp.json", "bench_decode_llamacpp_avx2.json")
    tables.record({**_serve_report(), "machine": "AMD EPYC, 2 cores"}, tmp_path / "serve_bench.json", "cmd for serve")
    text = tables.headline(tmp_path)
    assert "\nfloat32, greedy." in text and "each on the machine it names" in text
    assert "; AMD EPYC, 2 cores; `cmd for serve`" in text
    for name in ("tour.json", "bench_decode.json", "bench_decode_llamacpp.json"):
        assert f"; m; `cmd for {name}`" in text


@pytest.mark.parametrize("other", ["tour.json", "bench_decode.json", "bench_decode_llamacpp.json", "serve_bench.json"])
def test_headline_tells_apart_a_machine_that_differs_in_any_one_run(tmp_path, other):
    _write(tmp_path)
    tables.record({**REPORTS[other](), "machine": "other cpu"}, tmp_path / other, f"cmd for {other}")
    text = tables.headline(tmp_path)
    assert f"; other cpu; `cmd for {other}`" in text and "each on the machine it names" in text


def test_roofline_table_states_ratios_and_ceilings(tmp_path):
    _write(tmp_path, "01_roofline.json")
    text = decode_tables.roofline(tmp_path)
    assert "| decode B=1 | 0.5 | memory | 50.0 | 40.0 | 1.25 |" in text and "| prefill T=64 |" in text
    assert "the roofline's bandwidth is the larger, 25.0 GB/s" in text
    assert "| F.linear | 28.0 | 11.0 |" in text and "Fastest: at 1 row `F.linear`; at 8 rows `shards`. Above the ceiling at 1 row: `F.linear`." in text
    assert "| float16 | 0.5 | memory | 4.0 | 5.0 | 0.80 |" in text
    assert "float16 decode 0.12x float32's tokens/s (memory-bound at these ceilings)." in text  # 5 / 40
    assert "| compiled (`compile_decode`) | 45.0 | 90% |" in text
    # eager 1.25x the predicted time is within 25%; compiled 90% of the bound: 1.11x
    assert "eager 1.25x the predicted time, compiled 1.11x, so the compiled step reaches 90% of the bound" in text


def test_decode_tables_compute_ratios_from_the_runs(tmp_path):
    _write(tmp_path, "bench_decode.json", "bench_decode_llamacpp.json")
    text = decode_tables.decode(tmp_path)
    assert "| transformers (same GGUF) | 15.0 | 0.050 | 7.5 | **no** |" in text
    assert "Contiguous cache / transformers: **2.00x**." in text and "500.0 MB" in text
    text = decode_tables.decode_llamacpp(tmp_path)
    assert "| llama.cpp (same GGUF) | 120.0 | 120.0, 120.0, 120.0 | 96.6 |" in text
    assert "**1.20x**" in text and "(1.17, 1.20, 0.95: ahead in 2 of 3)" in text
    # 62 / 31, 72 / 62, 144 / 72
    assert "the 4-bit blocks 2.00x the float32 step; quantizing the output layer (int8 head) 1.16x eager; compiling 2.00x" in text
    assert "first 24)" in text
    _write(tmp_path, "bench_decode_llamacpp_avx2.json")  # the run capped at AVX2 names the cap and llama.cpp's build
    text = decode_tables.decode_llamacpp_avx2(tmp_path)
    assert "m (AVX2 by ATEN_CPU_CAPABILITY=avx2); llama.cpp built for AVX AVX2 F16C FMA, 2 threads for both" in text
    assert "`cmd for bench_decode_llamacpp_avx2.json`" in text


def test_paged_tables_from_serve_bench_fragmentation_and_bench_decode(tmp_path):
    _write(tmp_path, "serve_bench.json", "fragmentation.json", "bench_decode.json")
    text = paged_tables.serve_bench(tmp_path)
    assert "| the engine (continuous batching) | 100.0 | 150.0 | 1.00 / 2.00 | 0.100 / 0.200 | 100.0 | 64/64 |" in text
    assert "| transformers' continuous batching (paged\\|sdpa) | 50.0 |" in text and "| 63/64 |" in text
    assert "engine / one at a time 5.00x" in text and "engine / transformers 2.00x" in text
    assert "kv_utilization at full lengths 98.3%" in text
    assert "16.0% of KV blocks for n = 4" in text and "52.0% for beam width 4" in text
    text = paged_tables.fragmentation(tmp_path)
    assert "| paging, block size 16 | **98.5%** | 96.3% |  |" in text and "| paging, block size 1 / 256 | 100.0 / 79.7% |" in text
    assert "Paging wastes 1.5% at block size 16 on the ShareGPT-like trace." in text
    assert "within 2.6 points of the paper's without external fragmentation" in text  # 25.0 vs 22.4
    text = paged_tables.paged_decode(tmp_path)
    assert "| paged KV cache, block size 16 (`minillm.paged.generate_paged`) | 28.5 | yes |" in text
    assert "Paged is 5.0% slower than the contiguous one." in text


def test_speculative_tables_from_notebook_04(tmp_path):
    _write(tmp_path, "04_speculative.json")
    text = decode_tables.speculative(tmp_path)
    assert "| rewrite | 48 | 30.0 | 78.0 | 0.95 | 8% | 4.00 | 4.50x | 2.80x | 2.70x | 2.50x | **2.60x** | yes |" in text
    assert "| story | 48 | 30.0 | 27.0 |" in text and "| 0.90x | yes |" in text
    assert "verify(5) = 1.60, verify(17) = 2.10 decode steps" in text and "-10% to +4%" in text
    assert "| rewrite | 48 | 24 (6.30x) | 24 (7.90x) | 12.00 | 6.10x / 7.50x, 12.00 |" in text


# ---- python -m tools.tables on records it cannot read: exit 2 naming the file; 1 stays "out of date"

def _checkout(tmp_path):
    """A copy of the Markdown files with tables, of figures/ and of what the course's tables read (the lessons and
    the readings), for ``main --root``."""
    for rel in {**tables.FILES, **tables._quant.FILES, **tables._course.FILES}:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text((ROOT / rel).read_text(encoding="utf-8"), encoding="utf-8")
    (tmp_path / "figures").mkdir()
    for path in (ROOT / "figures").glob("*.json"):
        (tmp_path / "figures" / path.name).write_bytes(path.read_bytes())
    for folder, pattern in (("notebooks", "0*.ipynb"), ("docs/readings", "*.md")):
        (tmp_path / folder).mkdir(parents=True, exist_ok=True)
        for path in (ROOT / folder).glob(pattern):
            (tmp_path / folder / path.name).write_bytes(path.read_bytes())
    return tmp_path


def _with_null(path, *keys):
    rec = json.loads(path.read_text())
    inner = rec
    for k in keys[:-1]:
        inner = inner[k]
    inner[keys[-1]] = None
    path.write_text(json.dumps(rec))


BAD_RECORDS = {  # how a record is spoilt -> what the error must say
    "corrupt": (lambda p: p.write_text("tour ran at 30 tokens/s\n"), "not valid JSON"),
    "truncated": (lambda p: p.write_bytes(p.read_bytes()[:200]), "cut short?"),
    "empty": (lambda p: p.write_bytes(b""), "is empty"),
    "NUL bytes": (lambda p: p.write_bytes(b"\0" * 64), "holds NUL bytes (the first at byte 0"),
    "NULs after the JSON": (lambda p: p.write_bytes(p.read_bytes() + b"\0\0\0"), "holds NUL bytes"),
    "binary": (lambda p: p.write_bytes(bytes(range(256))), "holds NUL bytes"),
    "binary, no NUL": (lambda p: p.write_bytes(b"\xff\xfe\x89PNG"), "is not UTF-8 text (byte 0 is 0xff"),
    "null report": (lambda p: _with_null(p, "report"), "its report is null, not an object"),
    "null value": (lambda p: _with_null(p, "report", "rows", 0, "tokens_per_s"),
                   "cannot be tabulated (TypeError"),
    "a folder": (lambda p: (p.unlink(), p.mkdir()), "cannot be read"),
}


@pytest.mark.parametrize("kind", sorted(BAD_RECORDS))
def test_check_exits_2_naming_a_record_it_cannot_read(tmp_path, capsys, kind):
    root = _checkout(tmp_path)
    assert tables.main(["--check", "--root", str(root)]) == 0  # the copy is up to date
    spoil, says = BAD_RECORDS[kind]
    spoil(root / "figures" / "tour.json")
    assert tables.main(["--check", "--root", str(root)]) == 2
    err = capsys.readouterr().err
    assert says in err and str(root / "figures" / "tour.json") in err, err
    assert "figures/tour.json -- tour`" in err  # and the command that rewrites it
    assert "Traceback" not in err


def test_a_null_value_is_named_by_its_path_in_the_record(tmp_path, capsys):
    root = _checkout(tmp_path)
    _with_null(root / "figures" / "serve_bench.json", "report", "modes", "engine", "output_tokens_per_s")
    assert tables.main(["--root", str(root)]) == 2
    err = capsys.readouterr().err
    assert f"{root / 'figures' / 'serve_bench.json'} at report.modes.engine.output_tokens_per_s" in err, err


def test_a_binary_quantization_report_exits_2_naming_it(tmp_path, capsys):
    root = _checkout(tmp_path)
    (root / "figures" / "05_kquants.json").write_bytes(b"\x89PNG\r\n\x1a\n\xff")
    assert tables.main(["--check", "--root", str(root)]) == 2
    err = capsys.readouterr().err
    assert "05_kquants.json: is not UTF-8 text" in err and "minillm.lab.kquants" in err, err


def test_out_of_date_stays_exit_1_and_a_bad_record_rewrites_nothing(tmp_path, capsys):
    root = _checkout(tmp_path)
    readme = root / "README.md"
    stale = readme.read_text().replace("| tour |", "| a hand edit |", 1)
    readme.write_text(stale)
    assert tables.main(["--check", "--root", str(root)]) == 1
    assert capsys.readouterr().out == "README.md: out of date\n"
    # a record read only by docs/paged.md is cut short: the README, rebuilt first, is not rewritten either
    frag = root / "figures" / "fragmentation.json"
    frag.write_bytes(frag.read_bytes()[:100])
    assert tables.main(["--root", str(root)]) == 2
    assert readme.read_text() == stale
    assert "fragmentation.json: not valid JSON" in capsys.readouterr().err
    frag.write_bytes((ROOT / "figures" / "fragmentation.json").read_bytes())
    assert tables.main(["--root", str(root)]) == 0 and "| tour |" in readme.read_text()
    assert tables.main(["--check", "--root", str(root)]) == 0


def test_record_refuses_a_missing_folder_before_running_the_command(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        tables.record_command(tmp_path / "missing" / "r.json", ["no-such-command"])

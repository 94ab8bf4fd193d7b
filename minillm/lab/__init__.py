"""The lab: what measures the library. Benchmarks against baselines and peers, their figures, records and
commands; the library never imports it (an import-linter contract), so what a student reads stays free of
measurement code. One file per command, with its figures; ``python -m tools.tables`` rebuilds the README's
and docs' tables from the records:

    decode.py, llamacpp.py          ``bench decode``: naive path, KV caches, transformers; ``--peer llamacpp``
    products.py                     ``bench products``: every linear layer per row count and per kernel
    roofline_plots.py               the roofline's figures (the command is ``roofline/cli.py``)
    fragmentation.py                ``fragmentation``: reserved KV memory holding tokens, reservation vs paging
    engine_costs.py                 the attention paths' and the row cost model's timings (docs/paged.md)
    flex_paged.py                   FlexAttention reading the block pool against the indexed read (docs/paged.md)
    serve_bench.py, serve_bench_cli.py, online.py, serve_spec.py
                                    ``serve-bench``: the engine vs one at a time, static batches, transformers;
                                    ``--online`` (latency against request rate); ``--spec``
    spec.py, spec_plots.py          ``bench spec``: plain vs speculative decoding, predicted and measured
    quant.py, avenues.py, bitrate.py, bitrate_rows.py, kquants.py
                                    ``bench quant`` (``--avenues``, ``--bpw``), notebook 05b's rows, Q4_K_M vs llama.cpp
    stack.py, stack_plots.py        ``bench stack``: every technique together; tour.py: ``tour``
    peers.py, records.py, background.py, lessons.py
                                    peer loaders; records; background load; the lessons' helpers
"""

"""The lab: what measures the library. Benchmarks against baselines and peers, their figures, the
records they keep and the commands that run them; it imports the library and the server, and the library
never imports it (an import-linter contract in pyproject.toml), so what a student reads stays free of
measurement code. One file per command, with its figures:

    decode.py          ``bench decode``: the naive path, the KV caches, transformers; step time against position
    llamacpp.py        ``bench decode --peer llamacpp``: the 4-bit paths beside llama.cpp, bytes per token
    roofline_plots.py  the roofline's figures (notebooks 01 and 01a; ``python -m minillm roofline`` is roofline/cli.py)
    fragmentation.py   ``fragmentation``: reserved KV memory holding tokens, reservation vs paging; its figures
    engine_costs.py    the attention paths' and the row cost model's timings (docs/paged.md)
    serve_bench.py     ``serve-bench``: the engine vs one at a time, static batches, transformers
    serve_bench_cli.py its command (``--online``: online.py, latency against request rate)
    spec.py            ``bench spec``: plain vs speculative decoding, predicted and measured
    spec_plots.py      its figures (notebooks 04 and 04a)
    quant.py           ``bench quant``: methods x bits x group sizes, and its figures
    avenues.py         ``bench quant --avenues``: each GPTQ avenue in one run
    bitrate.py         ``bench quant --bpw``: variable bitrate beside uniform settings, and its figures
    bitrate_rows.py    ``python -m minillm.lab.bitrate_rows``: notebook 05b's end-to-end rows
    kquants.py         ``python -m minillm.lab.kquants``: our Q4_K_M file beside llama.cpp's
    tour.py            ``tour``: every technique against its baseline, one table
    peers.py           the one place transformers and llama.cpp are loaded
    records.py         a measurement kept with its command, date and load (``record``, ``read_record``)

The README's and docs' tables are rebuilt from the records by repository tooling outside the package
(``python -m tools.tables``).
"""

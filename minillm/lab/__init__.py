"""The lab: harnesses that measure the library (benchmarks against baselines and peers, their figures and
records). It imports the library and the server; the library never imports it (an import-linter
contract in pyproject.toml), so what a student reads stays free of measurement code. ``online.py``:
latency against request rate, the engine against static batching, in process and over HTTP
(``python -m minillm serve-bench --online``)."""

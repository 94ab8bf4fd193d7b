"""An OpenAI-compatible HTTP server over the engine: ``python -m minillm serve``.

* ``loop.py``: ``EngineLoop``, the one thread that drives the ``LLMEngine`` for every connection.
* ``protocol.py``: the requests and responses in OpenAI's shapes, their checks and error bodies.
* ``app.py``: the FastAPI routes (completions, chat completions, models, health, metrics), served by uvicorn.
* ``metrics.py``: ``/metrics`` in Prometheus' text format, under vLLM's metric names (``minillm:...``).
* ``cli.py``: the ``serve`` command.

Nothing here is imported by ``import minillm``: FastAPI and uvicorn load only when a server starts.
"""

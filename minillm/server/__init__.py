"""An OpenAI-compatible HTTP server over the engine: ``python -m minillm serve``.

* ``loop.py``: ``EngineLoop``, the one thread that drives the ``LLMEngine`` for every connection.
* ``protocol.py``: the requests and responses in OpenAI's and vLLM's shapes, their checks and error bodies.
* ``logprobs.py``: the model's log-probabilities of a prompt and its output (logprobs, echo), in OpenAI's shapes.
* ``relay.py``: between the engine's outputs and a response (prompts' streams merged, streamed tokens scored).
* ``app.py``: the FastAPI routes (completions, chat completions, tokenize, models, health, metrics), on uvicorn.
* ``metrics.py``: ``/metrics`` in Prometheus' text format, under vLLM's metric names (``minillm:...``).
* ``cli.py``: the ``serve`` command.

Nothing here is imported by ``import minillm``: FastAPI and uvicorn load only when a server starts.
"""

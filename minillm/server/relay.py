"""Between the engine's outputs and a response: several prompts' streams merged into one, a streamed choice's
new tokens scored as they arrive, and a prompt that is scored only (``max_tokens`` 0 with ``echo``), which the
engine never sees.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from ..paged.outputs import CompletionOutput
from .logprobs import Scorer
from .loop import RequestFailed


def scoring(scorers: dict, key, prompt_ids: list[int], params, new: list[int], top: int):
    """What the engine thread runs for a streamed choice's new tokens: their entries, through the choice's scorer
    (made at its first tokens, with the prompt fed)."""
    def run(engine):
        if key not in scorers:
            scorers[key] = Scorer(engine.model, len(prompt_ids) + params.max_new_tokens, top)
            scorers[key].extend(prompt_ids, want=False)
        return scorers[key].extend(new)
    return run


async def merged(streams):
    """(prompt number, output) from every stream as they come; a stream's ``RequestFailed`` is raised. Each
    stream's pump waits for room in a queue of one place per stream, so a stalled reader holds a bounded number."""
    if len(streams) == 1:
        async for out in streams[0].outputs():
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue(maxsize=len(streams))

    async def pump(p, stream):
        try:
            async for out in stream.outputs():
                await queue.put((p, out))
            await queue.put((p, None))
        except RequestFailed as e:
            await queue.put((p, e))

    pumps = [asyncio.ensure_future(pump(p, s)) for p, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            p, item = await queue.get()
            if isinstance(item, RequestFailed):
                raise item
            if item is None:
                left -= 1
            else:
                yield p, item
    finally:
        for task in pumps:
            task.cancel()


@dataclass
class Scored:
    """A prompt that is scored only (max_tokens 0 with echo): a ``RequestOutput``'s fields, n empty choices."""

    prompt_token_ids: list[int]
    n: int

    @property
    def outputs(self):
        return [CompletionOutput(i, "", [], None, "length") for i in range(self.n)]

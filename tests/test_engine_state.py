"""A long-lived engine holds bounded state: after thousands of requests, every table inside it (the block
manager's, the scheduler's, the requests', the step records, the trace writer's) is as large as after the
first thousand, so a server that runs for days does not grow."""

import pytest
import torch
from helpers import random_decoder

from minillm import SamplingParams
from minillm.paged import BlockManager, DoubleFreeError, LLMEngine, UnknownSequenceError
from minillm.paged import block_manager
from minillm.paged.block_manager import RECENTLY_FREED
from minillm.paged.stats import KEEP_RECORDS

V = 300


@pytest.fixture(scope="module")
def tiny():
    return random_decoder(V, scale=0.3)


def container_sizes(obj, path="engine", seen=None, depth=0) -> dict[str, int]:
    """len() of every list, dict, set and deque reachable through attributes (the model and tensors left out)."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth > 5 or isinstance(obj, (torch.nn.Module, torch.Tensor)):
        return {}
    seen.add(id(obj))
    sizes = {}
    if isinstance(obj, (list, dict, set, tuple)) or hasattr(obj, "__len__") and hasattr(obj, "popitem"):
        sizes[path] = len(obj)
        return sizes
    for name, value in getattr(obj, "__dict__", {}).items():
        sizes.update(container_sizes(value, f"{path}.{name}", seen, depth + 1))
    return sizes


def serve(engine, first: int, count: int) -> None:
    g = torch.Generator().manual_seed(first)
    for i in range(first, first + count):
        n = int(torch.randint(2, 40, (1,), generator=g))
        params = SamplingParams(max_tokens=int(torch.randint(1, 4, (1,), generator=g)), ignore_eos=True,
                                n=2 if i % 7 == 0 else 1)
        engine.add_request(str(i), torch.randint(0, V, (n,), generator=g).tolist(), params)
        if i % 64 == 63:
            while engine.has_unfinished_requests():
                engine.step()
    while engine.has_unfinished_requests():
        engine.step()


def test_tables_stay_bounded_over_many_requests(tiny, tmp_path, monkeypatch):
    """200 requests (some forking into two samples, some hitting the prefix cache), then 200 more: no table grew
    beyond what the engine's settings bound (the pool's blocks; twice the step records kept), the manager
    remembering the latest 64 frees (``RECENTLY_FREED``, lowered from 1,024 so that a short run reaches it)."""
    monkeypatch.setattr(block_manager, "RECENTLY_FREED", 64)
    engine = LLMEngine(tiny, num_blocks=48, max_num_batched_tokens=64, keep_records=10,
                       trace=tmp_path / "trace.jsonl")
    serve(engine, 0, 200)
    before = container_sizes(engine)
    serve(engine, 200, 200)
    after = container_sizes(engine)
    bound = max(engine.num_blocks, 2 * 10)
    grew = {k: (before.get(k, 0), n) for k, n in after.items() if n > max(before.get(k, 0), bound)}
    assert not grew, f"tables that grew with the number of requests (size after 200 -> after 400): {grew}"
    assert engine.manager.seq_ids() == [] and engine.manager.num_free_blocks == engine.num_blocks
    assert len(engine.manager._freed) == 64  # the latest frees only
    assert 10 <= len(engine.stats.records) < 20 and engine.stats.steps > 40
    assert [r.step for r in engine.stats.records] == list(range(engine.stats.steps - len(engine.stats.records),
                                                                engine.stats.steps))  # the latest, in order


def test_default_engine_keeps_a_bounded_number_of_step_records(tiny):
    engine = LLMEngine(tiny, num_blocks=16)
    assert engine.stats.keep_records == KEEP_RECORDS and KEEP_RECORDS is not None


def test_summary_covers_every_step_when_records_are_trimmed(tiny):
    """The summary's sums are the engine's life, not the kept records': the same run with 10 records kept and
    with all of them gives the same summary."""
    summaries = []
    for keep in (10, None):
        engine = LLMEngine(tiny, num_blocks=24, max_num_batched_tokens=16, keep_records=keep)
        serve(engine, 0, 40)
        summaries.append(engine.stats.summary(engine.block_size))
        if keep is None:
            used = [r.used_blocks for r in engine.stats.records]
            assert summaries[-1]["peak_blocks"] == max(used) and summaries[-1]["steps"] == len(used)
            assert summaries[-1]["mean_blocks"] == pytest.approx(sum(used) / len(used))
    assert summaries[0] == summaries[1] and summaries[0]["steps"] > 20


@pytest.mark.parametrize("keep", [-1, 2.5, "10", True])
def test_keep_records_refused_when_not_a_count(tiny, keep):
    with pytest.raises(ValueError, match="keep_records: the step records to keep must be an integer >= 0"):
        LLMEngine(tiny, num_blocks=16, keep_records=keep)


def test_block_manager_forgets_old_frees_but_still_refuses_them():
    """A double free among the latest frees says so; one long before is refused as unknown (nothing is freed
    twice either way), and the manager remembers at most RECENTLY_FREED ids."""
    m = BlockManager(num_blocks=4, block_size=2)
    for i in range(RECENTLY_FREED + 10):
        m.allocate(i, [1, 2, 3])
        m.grow(i, 3)
        m.free(i)
    assert len(m._freed) == RECENTLY_FREED and m.num_free_blocks == 4
    with pytest.raises(DoubleFreeError, match=f"sequence {RECENTLY_FREED + 9} was already freed"):
        m.free(RECENTLY_FREED + 9)
    with pytest.raises(UnknownSequenceError, match="sequence 0 was never allocated .or was freed before the last"):
        m.free(0)
    assert m.num_free_blocks == 4

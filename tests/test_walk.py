"""tools/walk.py, the closing notes' measure of how far a reader walks: it must find its target."""

import pytest

from tools import walk


@pytest.mark.slow
def test_generate_walk_reaches_the_attention_over_blocks(model_path):
    frames = walk.walk_generate()
    assert frames, "tools.walk generate found no attention over the KV blocks: its targets no longer run"
    assert frames[0] == ("minillm/paged/llm.py", "generate")
    path, name = frames[-1]
    assert path in ("minillm/paged/attention.py", "minillm/fast/paged.py", "minillm/fast/kernels/__init__.py"), frames[-1]
    assert name in ("paged_attention", "attend_groups", "attend_blockwise", "gather_padded"), frames[-1]
    assert ("minillm/paged/engine.py", "step") in frames


def test_stack_at_stops_at_the_first_target_and_keeps_package_frames():
    from minillm.fast.paged import buckets

    frames = walk.stack_at({"fast/paged.py": {"buckets"}}, lambda: buckets([3, 5], 128.0))
    assert frames == [("minillm/fast/paged.py", "buckets")]
    assert walk.stack_at({"fast/paged.py": {"buckets"}}, lambda: None) == []

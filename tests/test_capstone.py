"""The capstone: the pieces of the exercises plugged into the model serve a batch and match the package's
engine token for token (a tiny random model: fast); a wrong piece shows where the tokens part; a piece that
is missing or breaks the bookkeeping is refused in words."""

import pytest
import torch

from minillm.exercises import EXERCISES
from minillm.exercises.capstone import PIECES, compare_with_engine, serve
from minillm.exercises.ex_cache import _rope
from test_engine_beam import V, prompt, tiny  # noqa: F401  (the tiny random model fixture)


def reference_pieces():
    return {name: EXERCISES[name].reference for name in PIECES}


def prompts():
    return [prompt(n, seed) for seed, n in enumerate((5, 9, 3))]


@pytest.mark.parametrize("gamma", [0, 3])
def test_the_reference_pieces_serve_what_the_engine_serves(tiny, gamma):  # noqa: F811
    # 10 blocks of 4 for three sequences growing to 21 tokens: the scheduler must preempt
    same, text, result = compare_with_engine(tiny, prompts(), reference_pieces(), max_new_tokens=10, num_blocks=10,
                                             num_speculative_tokens=gamma)
    assert same, text
    assert text.count("the same as the engine's") == 3
    assert result.preemptions > 0 or gamma


def test_a_wrong_piece_shows_where_the_tokens_part(tiny):  # noqa: F811
    pieces = reference_pieces()
    pieces["rope_at_offset"] = lambda x, start, base: _rope(x, torch.arange(x.shape[2]), base)  # restarts at 0
    same, text, _ = compare_with_engine(tiny, prompts(), pieces, max_new_tokens=6)
    assert not same and "differs from token" in text, text


def test_missing_or_inconsistent_pieces_are_refused(tiny):  # noqa: F811
    pieces = reference_pieces()
    del pieces["slot_mapping"]
    with pytest.raises(ValueError, match="pieces: give your functions slot_mapping"):
        serve(tiny, prompts(), pieces)
    pieces = reference_pieces()
    miscount = lambda d, p, a, f: (d, p, a, f + 1)  # noqa: E731  (one block more than the tables leave)
    pieces["schedule_step"] = lambda *args: miscount(*EXERCISES["schedule_step"].reference(*args))
    with pytest.raises(ValueError, match="schedule_step: says .* blocks are free after the step"):
        serve(tiny, prompts(), pieces)

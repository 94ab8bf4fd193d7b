"""minillm.speculative.analysis and .plots: counts by draft position, the alpha a speedup needs, the replay
grid, and the figures of notebooks 04 / 04a (written as PNGs). No model needed."""

import pytest

from minillm.lab import spec_plots as plots
from minillm.speculative import SpeculativeStats, expected_tokens_per_pass
from minillm.speculative.analysis import (
    acceptance_counts,
    alpha_for_speedup,
    replay_grid,
)


def test_acceptance_counts_by_hand_and_against_the_stats():
    drafted, accepted = [4, 0, 4, 2], [4, 0, 1, 2]
    reached, ok = acceptance_counts(drafted, accepted)
    # draft 1 tested in passes 1, 3, 4; draft 2 too (pass 3 rejected it); drafts 3 and 4 only in pass 1
    assert reached == [3, 3, 1, 1] and ok == [3, 2, 1, 1]
    rates = SpeculativeStats(drafted=drafted, accepted=accepted).acceptance_by_position()
    assert rates == [o / n for o, n in zip(ok, reached)]
    with pytest.raises(ValueError, match="accepted must lie"):
        acceptance_counts([1], [2])
    with pytest.raises(ValueError, match="one entry per pass"):
        acceptance_counts([1, 1], [1])


def test_alpha_for_speedup_solves_the_closed_form():
    gamma, c, v = 4, 0.05, 1.1
    alpha = alpha_for_speedup(2.0, gamma, c, v)
    assert 0 < alpha < 1
    assert expected_tokens_per_pass(alpha, gamma) / (gamma * c + v) == pytest.approx(2.0, rel=1e-6)
    # a perfect draft at gamma 2 with c = 0.25 and verify(3) = 1.1: 3 tokens for 1.6 steps, under 2x
    assert alpha_for_speedup(2.0, 2, 0.25, 1.1) is None
    assert alpha_for_speedup(0.5, 2, 0.25, 1.1) == 0.0
    with pytest.raises(ValueError, match="gamma"):
        alpha_for_speedup(2.0, 0, 0.1, 1.0)


def test_replay_grid_counts_passes_by_hand():
    prompt, answer = [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6]  # the answer copies the prompt
    grid = replay_grid(prompt, answer, vocab_size=10, gammas=[4], min_ns=(1, 2))
    # min_n 1: no match for 6, one token; then "1" matches: 4 drafts accepted + 1 = 5 tokens; 6 in 2 passes
    assert grid[1][4] == 3.0
    # min_n 2: no draft twice ("6", then "6 1"); then "1 2" matches: 3 drafts (room) + 1; 6 in 3 passes
    assert grid[2][4] == 2.0
    with pytest.raises(ValueError, match="min_ns"):
        replay_grid(prompt, answer, 10, [4], min_ns=(4,))


def _row(name, drafted, accepted):
    return {"workload": name, "drafted": drafted, "accepted": accepted, "measured_speedup": 2.0,
            "predicted_speedup": 2.1, "leviathan_speedup": 3.0, "leviathan_speedup_with_verify_cost": 2.9,
            "expected_tokens_per_pass": 3.5, "tokens_per_pass_alpha": 2.5, "tokens_per_target_pass": 2.4,
            "passes_without_draft": 0.25}


def test_every_figure_is_written_as_a_png(tmp_path):
    rows = [_row("rewrite (input-grounded)", [4, 0, 4], [4, 0, 1]), _row("story (open-ended)", [0, 0], [0, 0])]
    sweep = {"best": {"rewrite (input-grounded)": {"measured": 2, "predicted": 2}},
             "rows": [{"workload": "rewrite (input-grounded)", "gamma": g, "measured_speedup": s,
                       "predicted_speedup": s + 0.1} for g, s in ((1, 1.5), (2, 2.0), (4, 1.8))]}
    paths = [plots.plot_verify_cost({1: 1.0, 2: 1.1, 3: 1.2}, tmp_path / "v.png"),
             plots.plot_acceptance_by_position(rows, tmp_path / "a.png", gamma=4),
             plots.plot_predicted_vs_measured(rows, tmp_path / "p.png"),
             plots.plot_tokens_per_pass(rows, tmp_path / "t.png", gamma=4),
             plots.plot_speedup_vs_gamma(sweep, tmp_path / "g.png"),
             plots.plot_replay_tokens_per_pass({"rewrite (input-grounded)": {1: {1: 1.5, 2: 2.5}, 2: {1: 1.2, 2: 1.8}}},
                                               tmp_path / "r.png")]
    for path in paths:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path
    assert plots.short_name("rewrite (input-grounded)") == "rewrite"

"""The gallery of exercises 11-14 (the engine's inner steps and the file formats): each typical wrong answer
fails its check with the hint that names its mistake (tests/test_exercises_gallery.py holds exercises 1-10)."""

import math

import pytest
import torch

from minillm.exercises import ex_engine, ex_formats, ex_spec
from test_exercises_gallery import run


# ---- the wrong answers, as students write them ----------------------------------------------------

def gather_ignoring_table(k_pool, block_table, seq_len):
    return k_pool.reshape(-1, k_pool.shape[2], k_pool.shape[3])[:seq_len].transpose(0, 1)


def gather_not_cut(k_pool, block_table, seq_len):
    return k_pool[torch.tensor(block_table)].reshape(-1, k_pool.shape[2], k_pool.shape[3]).transpose(0, 1)


def online_without_rescale(q, k_blocks, v_blocks):
    D = q.shape[0]
    m, l, acc = float("-inf"), 0.0, torch.zeros(D)
    for k, v in zip(k_blocks, v_blocks):
        s = k @ q / math.sqrt(D)
        m = max(m, float(s.max()))
        p = torch.exp(s - m)
        l, acc = l + float(p.sum()), acc + p @ v  # what came before was weighted by the old max
    return acc / l, m, l


def schedule_preempt_oldest(running, waiting, free, block_size, max_num_seqs):
    return ex_engine.reference_schedule(running, waiting, free, block_size, max_num_seqs, victim="oldest")


def ngram_matches_itself(tokens, gamma, max_n, min_n):
    for n in range(max_n, min_n - 1, -1):
        if len(tokens) <= n:
            continue
        for start in range(len(tokens) - n, -1, -1):  # includes the suffix itself
            if tokens[start:start + n] == tokens[-n:]:
                return tokens[start + n:start + n + gamma]
    return []


def rollback_forgets_pending(num_cached, num_drafts, num_accepted, block_size):
    kept = num_cached + num_accepted
    return kept, num_accepted + 1, num_drafts - num_accepted, 0


def rtn_without_zero_in_range(w, bits):
    lo, hi = w.min(1).values, w.max(1).values
    scale = ((hi - lo) / (2 ** bits - 1)).half().float()
    return scale, torch.round(-lo / scale).clamp(0, 2 ** bits - 1).long()


def pack_nibbles_swapped(scales, mins):
    sc, m = scales.to(torch.int32), mins.to(torch.int32)
    lo, mid = sc[:, :4] | ((sc[:, 4:] >> 4) << 6), m[:, :4] | ((m[:, 4:] >> 4) << 6)
    return torch.cat([lo, mid, (m[:, 4:] & 15) | ((sc[:, 4:] & 15) << 4)], 1).to(torch.uint8)


def bitrate_greedy(errors, costs, budget):
    return ex_formats._greedy(errors, costs, budget)


GALLERY = [
    ("paged_gather", gather_ignoring_table, "the block table is not used"),
    ("paged_gather", gather_not_cut, "cut the keys to seq_len"),
    ("paged_gather", lambda p, t, n: ex_engine.reference_gather(p, t, n).transpose(0, 1), "transpose"),
    ("online_softmax_attention", online_without_rescale, "by exp(old max - new max) before adding"),
    ("schedule_step", schedule_preempt_oldest, "preempt the newest running sequence"),
    ("ngram_propose", ngram_matches_itself, "the suffix matches itself"),
    ("rollback_after_verify", rollback_forgets_pending, "also wrote the pending token"),
    ("rtn_scale_zero", rtn_without_zero_in_range, "the range must include 0"),
    ("pack_q4k_scales", pack_nibbles_swapped, "the scale's 4 low bits in the low nibble"),
    ("choose_bitrate", bitrate_greedy, "greedy is not optimal"),
]


def _variants():
    sched, ngram, online, rtn, pack = (ex_engine.reference_schedule, ex_spec._ngram, ex_engine._online,
                                       ex_formats._rtn, ex_formats._pack)
    return [
        ("paged_gather", lambda p, t, n: ex_engine.reference_gather(p, [t[0]] * len(t), n), "compare position"),
        ("online_softmax_attention", lambda *a: online(*a, rescale_sum=False), "the running sum must be rescaled"),
        ("online_softmax_attention", lambda *a: online(*a, divide=False), "divide it by the running sum"),
        ("online_softmax_attention", lambda *a: online(*a, scaled=False), "sqrt(D)"),
        ("schedule_step", lambda *a: sched(*a, admit_after_preempt=True), "admit no one"),
        ("schedule_step", lambda *a: sched(*a, skip_unfit=True), "first come, first served"),
        ("schedule_step", lambda *a: sched(*a, seats_slack=1), "max_num_seqs counts every sequence"),
        ("schedule_step", lambda *a: sched(*a, free_victim=False), "gives all its blocks back"),
        ("schedule_step", lambda *a: sched(*a, boundary=1), "off by one"),
        ("ngram_propose", lambda *a: ngram(*a, latest=False), "the latest earlier occurrence"),
        ("ngram_propose", lambda *a: ngram(*a, longest=False), "the longest n first"),
        ("ngram_propose", lambda *a: ngram(*a, cap=False), "cap the draft"),
        ("ngram_propose", lambda *a: ngram(*a, follow=False), "not the match itself"),
        ("rollback_after_verify", lambda c, k, a, bs: (c + 1 + a, a, k - a, ex_spec.reference_rollback(c, k, a, bs)[3]),
         "one more token than it accepts"),
        ("rollback_after_verify", lambda c, k, a, bs: (c + 1 + a, a + 1, k - a + 1, 0), "only the rejected drafts"),
        ("rollback_after_verify", lambda c, k, a, bs: (c + 1 + a, a + 1, k - a, (k - a) // bs), "blocks freed"),
        ("rtn_scale_zero", lambda w, b: rtn(w, b, fp16=False), "round the scale to float16"),
        ("rtn_scale_zero", lambda w, b: rtn(w, b, levels="2^b"), "2^b - 1 steps"),
        ("rtn_scale_zero", lambda w, b: rtn(w, b, round_zero=False), "round it to an integer"),
        ("pack_q4k_scales", lambda s, m: pack(s, m, shift=4), "(<< 6)"),
        ("pack_q4k_scales", lambda s, m: pack(s, m, high_from="low"), "value >> 4"),
        ("choose_bitrate", lambda e, c, b: [len(x) - 1 for x in c], "over the budget"),
        ("choose_bitrate", lambda e, c, b: ex_formats._greedy(e, c, b, order="cost"), "wastes the budget"),
    ]


CASES = GALLERY + _variants()


@pytest.mark.parametrize("name, fn, hint", CASES, ids=[f"{n}-{h[:24]}" for n, _, h in CASES])
def test_typical_wrong_answer_gets_its_hint(name, fn, hint):
    report, text = run(name, fn)
    assert not report.passed
    assert any(hint in f.hint for f in report.failures), text
    assert "Traceback" not in text


def test_every_new_exercise_has_a_wrong_answer():
    names = {"paged_gather", "online_softmax_attention", "schedule_step", "ngram_propose", "rollback_after_verify",
             "rtn_scale_zero", "pack_q4k_scales", "choose_bitrate"}
    assert {n for n, _, _ in GALLERY} == names


def test_the_scheduler_rules_agree_with_the_package_scheduler():
    """reference_schedule's rules against minillm.paged.Scheduler on the same state (decodes only, then
    admission of waiting prompts), step after step."""
    from minillm.paged import BlockManager, Scheduler, Sequence

    g = torch.Generator().manual_seed(3)
    for trial in range(20):
        bs, num_blocks = 4, int(torch.randint(4, 12, (), generator=g))
        manager = BlockManager(num_blocks, bs, enable_prefix_caching=False)
        sched = Scheduler(manager, max_num_seqs=3, max_num_batched_tokens=10_000)
        prompts = [torch.randint(0, 50, (int(torch.randint(1, 9, (), generator=g)),), generator=g).tolist()
                   for _ in range(5)]
        seqs = [Sequence(i, f"r{i}", 0, (i, 0), p, len(p)) for i, p in enumerate(prompts)]
        for s in seqs:
            sched.add(s)
        for step in range(8):
            running = [(s.seq_id, s.num_computed_tokens) for s in sched.running]  # holds these; decodes the next
            waiting = [(s.seq_id, s.num_tokens) for s in sched.waiting]
            state = (running, waiting, manager.num_free_blocks, bs, 3)
            out = sched.schedule()
            got = ([s.seq_id for s, _ in out.scheduled if s not in out.admitted], [s.seq_id for s in out.preempted],
                   [s.seq_id for s in out.admitted], manager.num_free_blocks)
            assert got == tuple(ex_engine.reference_schedule(*state)), (trial, step, state)
            manager.commit()
            for s, n in out.scheduled:  # the step ran: its tokens are computed, one token sampled per sequence
                s.num_computed_tokens += n
                s.token_ids.append(7)

"""Notebook 04's and 04a's notes: the Markdown the speculative-decoding lessons show after they measure, and
04a's record (with the numbers docs/speculative.md quotes through ``lessons.draft_summary``).

Like ``lesson_notes`` (which says why the wording lives outside the notebooks), one function per note:

* 04: ``verify_note``, ``positions_note``, ``closed_form_note``, ``accounting_note``, ``spec_summary``;
* 04a: ``draft_alpha_note``, ``draft_need_note``, ``replay_note``, ``sweep_note``, ``appendix_record``,
  ``appendix_summary``.
"""

from __future__ import annotations

import math
import statistics

from ..speculative.analysis import acceptance_counts
from .spec_plots import short_name


def verify_note(steps: dict[int, float]) -> str:
    """Notebook 04's reading of the verify cost (``steps``: {k: verify(k) / verify(1)})."""
    jumps = {k: steps[k] - steps[k - 1] for k in range(2, max(steps) + 1)}
    big = max(jumps, key=jumps.get)
    cost = ("almost nothing" if steps[5] < 1.2 else "a fraction of a decode step" if steps[5] < 2
            else "more than a decode step")
    return (f"Verifying 4 drafts (k = 5) costs **{steps[5]:.2f} decode steps** and 16 drafts (k = 17) "
            f"**{steps[17]:.2f}**, against 5 and 17 steps token by token, so a rejected draft costs {cost}. "
            f"The largest single rise is from k = {big - 1} to k = {big} (+{jumps[big]:.2f} of a step); from k = 2 to 17 "
            f"each row adds {(steps[17] - steps[2]) / 15:.3f} on average. One row to two is where minillm's `Linear` "
            "changes kernels: one row runs as column shards, two rows or more through oneDNN's packed weights "
            "(notebook 01's layout cell measures both, at batch 1 and 8, on the machine at hand). On a shared machine "
            "each point also carries timing noise. Where verification costs more (another kernel, another machine), "
            "a wrong draft costs more, which is why `NgramProposer` keeps a `min_n` (the shortest match that drafts).")


def positions_note(rows: list[dict]) -> str:
    """Notebook 04's acceptance by draft position, per workload, in words (the counts of its figure)."""
    lines, sharp = [], []
    for r in rows:
        reached, ok = acceptance_counts(r["drafted"], r["accepted"])
        first = f"{ok[0]} of {reached[0]}" if reached else "0 of 0"
        later_reached, later_ok = sum(reached[1:]), sum(ok[1:])
        lines.append(f"* {short_name(r['workload'])}: position 1 accepted in {first} passes that drafted; later "
                     f"positions, once reached, in {later_ok} of {later_reached}")
        if later_reached >= 10 and later_ok >= 0.9 * later_reached:
            sharp.append(short_name(r["workload"]))
    return ("How all-or-nothing prompt lookup is, per workload (the counts of the figure):\n\n" + "\n".join(lines)
            + "\n\nA pass is nearly all-or-nothing (later positions, once reached at least 10 times, accepted 90% of "
            f"the time or more) on {', '.join(sharp) or 'no workload'}: once a draft lines up with a stretch of the "
            "prompt that the answer copies, the answer keeps following it until it leaves the prompt. Where few "
            "passes get past position 1, the later rates rest on a handful of passes and say little.")


def closed_form_note(rows: list[dict], steps: dict[int, float]) -> str:
    """Notebook 04: where Leviathan et al.'s closed form goes wrong, assumption by assumption."""
    change = [r["leviathan_speedup_with_verify_cost"] / r["leviathan_speedup"] - 1 for r in rows]
    drop = {short_name(r["workload"]): 1 - r["tokens_per_pass_alpha"] / r["expected_tokens_per_pass"] for r in rows}
    worst = max(drop, key=drop.get)
    worst_row = next(r for r in rows if short_name(r["workload"]) == worst)
    moved = {short_name(r["workload"]): r["predicted_speedup_alpha"] / r["leviathan_speedup_with_verify_cost"] - 1
             for r in rows}
    up = [f"{n} ({100 * m:+.0f}%)" for n, m in moved.items() if m > 0.005]
    down = [f"{n} ({100 * m:+.0f}%)" for n, m in moved.items() if m < -0.005]
    errors = [r["measured_speedup"] / r["predicted_speedup"] - 1 for r in rows]
    bigger = ("the passes without drafts move" if max(abs(m) for m in moved.values()) > abs(change[0])
              else "the verify cost moves")
    return f"""**Where the closed form goes wrong.** It makes two assumptions. *Verification costs one decode
step:* the measured verify(5) is {steps[5]:.2f} decode steps, so charging it moves the closed form by
{100 * change[0]:+.0f}% on every workload. *Gamma drafts in every pass:* prompt lookup drafts nothing when no
n-gram matches; such a pass emits one token, but it also costs one decode step instead of verify(5). Counting
each pass's actual drafts therefore cuts both the expected tokens per pass (by up to {100 * drop[worst]:.0f}%:
{worst}, {worst_row['passes_without_draft']:.0%} of passes without a draft) and the cost per pass, and moves the
prediction either way: up for {', '.join(up) or 'no workload'}, where the cheaper passes weigh more than the
tokens lost, down for {', '.join(down) or 'no workload'}. Of the two assumptions, {bigger} the prediction more on
this run. Using the measured tokens per pass instead of alpha's i.i.d. model gives the proposer-aware
prediction, within {100 * max(abs(e) for e in errors):.0f}% of the measured speedup on every workload
({100 * min(errors):+.0f}% to {100 * max(errors):+.0f}%)."""


def accounting_note(rows: list[dict], verify: dict[int, float]) -> str:
    """Notebook 04: the prediction on the measurement's accounting (after the first token), and plain
    decoding's step against verify(1)."""
    errors = [r["measured_speedup"] / r["predicted_speedup"] - 1 for r in rows]
    after = [r["measured_speedup"] / r["predicted_speedup_after_first_token"] - 1 for r in rows]
    plain_ms = statistics.median(1e3 / r["plain_tokens_per_s"] for r in rows)
    ratio = plain_ms / (1e3 * verify[1])
    return (f"On the measurement's accounting the prediction is {100 * min(after):+.0f}% to {100 * max(after):+.0f}% "
            f"from the measured speedup (against {100 * min(errors):+.0f}% to {100 * max(errors):+.0f}% above). Plain "
            f"decoding's step took {plain_ms:.1f} ms (median over the workloads), verify(1) {1e3 * verify[1]:.1f} ms: a "
            f"plain step {'slower' if ratio > 1 else 'faster'} than verify(1) by {abs(ratio - 1):.0%} "
            f"{'raises' if ratio > 1 else 'lowers'} the measured speedups against the prediction by up to that much "
            "(the speculative passes have their own time outside the forward). Appendix 04a shows the accounting at "
            "work on a sweep over gamma, where a large gamma leaves only a few passes.")


def spec_summary(report: dict, steps: dict[int, float]) -> str:
    """Notebook 04's closing note from ``bench_spec``'s report and the verify cost in decode steps."""
    rows = report["rows"]
    by = {short_name(r["workload"]): r for r in rows}
    grounded = [r for r in rows if "input-grounded" in r["workload"]]
    met = [f"{short_name(r['workload'])} (alpha {r['alpha']:.2f})" for r in grounded if r["measured_speedup"] >= 2]
    missed = [f"{short_name(r['workload'])} (alpha {r['alpha']:.2f})" for r in grounded if r["measured_speedup"] < 2]
    rw, st = by["rewrite"], by["story"]
    return f"""{report['machine']}, float32, batch 1, greedy, n-gram prompt lookup (c = 0), up to 64 new tokens:

* **What verification costs:** one target forward over 5 tokens costs {steps[5]:.2f} decode steps,
  over 17 tokens {steps[17]:.2f} (token by token: 5 and 17).
* **An answer that copies its prompt** (rewrite, gamma 4): alpha {rw['alpha']:.2f},
  {rw['tokens_per_target_pass']:.2f} tokens per target pass, **{rw['measured_speedup']:.2f}x**
  faster than plain cached decoding (predicted {rw['predicted_speedup']:.2f}x).
* **Open-ended text** (story, gamma 4): alpha {st['alpha']:.2f},
  {st['passes_without_draft']:.0%} of passes without a draft, {st['measured_speedup']:.2f}x.
* Greedy tokens identical to plain decoding in every run: {all(r['same_tokens'] for r in rows)}.

Of the input-grounded prompts, prompt lookup at least doubled the decode speed on {', '.join(met) or 'none'} and
stayed below 2x on {', '.join(missed) or 'none'}: it pays where the answer reproduces its input and not where the
model answers in its own words. Appendix 04a asks whether a draft model, another prompt-lookup setting or another
gamma closes that gap."""


# ---------------------------------------------------------------- 04a


def draft_alpha_note(drafts: dict, losses: list[float], floor: float) -> str:
    """Notebook 04a: is the distilled draft's alpha different from the untrained one's beyond sampling
    noise (a two-proportion z test over the examined drafts)?"""
    seen = {name: (sum(r["accepted"]), sum(min(a + 1, k) for k, a in zip(r["drafted"], r["accepted"])))
            for name, r in drafts.items()}
    (a_u, n_u), (a_d, n_d) = seen["untrained self-draft"], seen["distilled"]
    pool = (a_u + a_d) / max(1, n_u + n_d)
    se = math.sqrt(pool * (1 - pool) * (1 / max(1, n_u) + 1 / max(1, n_d)))
    z = (a_d / max(1, n_d) - a_u / max(1, n_u)) / se if se > 0 else 0.0
    order = "lower than" if a_d * n_u < a_u * n_d else "higher than" if a_d * n_u > a_u * n_d else "equal to"
    noise = (f"With this few accepted drafts the two are within sampling noise of each other (two-proportion z = "
             f"{z:+.1f}, |z| < 2)" if abs(z) < 2 else
             f"The difference is larger than sampling noise (two-proportion z = {z:+.1f})")
    return (f"The distilled draft's alpha, {a_d} of {n_d} examined drafts accepted, is **{order}** the untrained "
            f"one's, {a_u} of {n_u}. {noise}. What the distillation measurably did is lower the cross-entropy to the "
            f"target, {sum(losses[:5]) / 5:.2f} -> {sum(losses[-5:]) / 5:.2f} nats against a floor of {floor:.2f}: still "
            "far from making the draft's greedy token the target's.")


def draft_need_note(c: float, steps: dict[int, float], need: dict[int, float | None], best_alpha: float) -> str:
    """Notebook 04a: what a perfect draft of cost ``c`` gives per gamma, and the alpha 2x needs (``need``:
    {gamma: alpha or None}); ``best_alpha``: the best alpha the drafts built reached."""
    gammas = sorted(need)
    reachable = {g: a for g, a in need.items() if a is not None}
    perfect = {g: (g + 1) / (g * c + steps[g + 1]) for g in gammas}
    best = max(gammas, key=perfect.get)
    if best == gammas[-1]:
        where = (", the edge of the grid: with every draft accepted, one more draft adds a whole token for c plus one "
                 "more verified row, so a perfect draft favours the largest gamma. A real draft, accepted with alpha < 1, "
                 "does not: ")
    else:
        where = ", inside the grid (past it, one more draft costs more than the token it adds). "
    if reachable:
        easiest = min(reachable, key=reachable.get)
        needs = (f"for 2x the draft needs alpha of at least **{reachable[easiest]:.2f}**, lowest at gamma {easiest} of "
                 f"{gammas[0]}..{gammas[-1]}; ")
    else:
        needs = f"no gamma up to {gammas[-1]} reaches 2x even with a perfect draft; "
    if not where.endswith(": "):
        needs = needs[0].upper() + needs[1:]
    return (f"At gamma 2 a perfect draft would cost 2c + verify(3) / verify(1) = {2 * c + steps[3]:.2f} decode steps "
            f"for 3 tokens: at most **{3 / (2 * c + steps[3]):.2f}x**. Over gamma {gammas[0]}..{gammas[-1]} the perfect "
            f"draft's speedup is best, {perfect[best]:.2f}x, at gamma {best}{where}{needs}the drafts built here reach "
            f"alpha {best_alpha:.2f} at best, so each pass pays gamma c for drafts the target rejects. The early exit "
            "starts far from the target (the cross-entropy above), and a short training run on a CPU (the seconds "
            "above) leaves its greedy token rarely equal to the target's. The papers' speedups (Leviathan et al.: "
            "2-3x on T5-XXL; Chen et al.: 2-2.5x on Chinchilla 70B) come from drafts far smaller than their targets, "
            "on accelerators where verifying a few tokens costs about one decode step; prompt lookup has c = 0 and "
            "pays whenever the answer copies its context.")


def replay_note(best: dict, grids: dict, answers: dict, gamma_max: int = 32) -> str:
    """Notebook 04a: which answers prompt lookup cannot bring to 2 tokens per pass at any setting, and where
    the others stop growing (``best``: {workload: (tokens per pass, smallest gamma, min_n)})."""
    low = [short_name(n) for n, (tpp, _, _) in best.items() if tpp < 2]
    plateau = []
    for name, (tpp, g, n) in best.items():
        if tpp >= 2:
            flat = all(grids[name][n][x] == tpp for x in range(g, gamma_max + 1))
            plateau.append(f"{short_name(name)} reaches its most, {tpp:.2f} tokens per pass, at gamma {g} (min_n {n})"
                           + (f" and stays there up to gamma {gamma_max}: {len(answers[name])} tokens in "
                              f"{round(len(answers[name]) / tpp)} passes" if flat else ", then falls again"))
    return (f"For {' and '.join(low) or 'no workload'} no gamma and no match length brings prompt lookup to 2 tokens "
            "per pass, before any verify cost: the answers take too little from their prompts. For the answers that "
            "copy their prompt, tokens per pass grow with gamma until the passes are cut where the answer leaves the "
            "prompt (or ends), and from there on a larger gamma changes nothing: " + "; ".join(plateau) + ".")


def sweep_note(sweep: dict, steps: dict[int, float]) -> str:
    """Notebook 04a: the live gamma sweep, prediction against measurement per workload."""
    gammas = sorted({r["gamma"] for r in sweep["rows"]})
    lines = []
    for name, b in sweep["best"].items():
        mine = {r["gamma"]: r for r in sweep["rows"] if r["workload"] == name}
        errs = [mine[g]["measured_speedup"] / mine[g]["predicted_speedup"] - 1 for g in gammas]
        errs_after = [mine[g]["measured_speedup"] / mine[g]["predicted_speedup_after_first_token"] - 1 for g in gammas]
        top = mine[b["measured"]]
        n_tokens = round(top["tokens_per_target_pass"] * top["passes"])
        past = [g for g in gammas if g > b["measured"]]
        tail = (f"; at gamma {past[-1]} it took {mine[past[-1]]['passes']} passes, so there verify(1 + gamma) grew and "
                "the passes did not shrink." if past and mine[past[-1]]["passes"] >= top["passes"] else ".")
        lines.append(
            f"* **{short_name(name)}**: measured / predicted {100 * min(errs):+.0f}% to {100 * max(errs):+.0f}% over the "
            f"grid (gamma {gammas[0]}: {100 * errs[0]:+.0f}%, gamma {gammas[-1]}: {100 * errs[-1]:+.0f}%); against the "
            f"prediction after the first token, {100 * min(errs_after):+.0f}% to {100 * max(errs_after):+.0f}%. Best gamma: "
            f"{b['predicted']} predicted, {b['measured']} measured ({top['measured_speedup']:.2f}x), where the "
            f"{n_tokens}-token answer took {top['passes']} passes ({top['tokens_per_target_pass']:.2f} tokens per pass, "
            f"the first pass keeping {top['first_pass_tokens']}){tail}")
    if not all(b["predicted"] == b["measured"] for b in sweep["best"].values()):
        lines.append("\nWhere the predicted and measured best gammas differ, compare their measured speedups: on a flat "
                     "top, points within a few percent of each other are within the timing noise of two runs.")
    lines.append(f"\nThe verify costs are this notebook's own (section 1: verify(5) = {steps[5]:.2f} decode steps), so at "
                 "gamma 4 the prediction can differ from notebook 04's table by the change in the verify costs between "
                 "the two runs.")
    return "\n".join(lines)


def appendix_record(machine: str, sweep: dict, steps: dict[int, float], *, c: float, log: dict, floor: float,
                    drafts: dict, need: dict[int, float | None], best: dict) -> dict:
    """Notebook 04a's record (``figures/04a_gamma_sweep.json``): the sweep in notebook 04's record shape, and
    the draft model's and the replay's numbers under "draft" and "replay" (what ``lessons.draft_summary``
    puts into docs/speculative.md's words)."""
    losses, gammas = log["losses"], sorted(need)
    reachable = {g: a for g, a in need.items() if a is not None}
    easiest = min(reachable, key=reachable.get) if reachable else None
    rewrite = best["rewrite (input-grounded)"]
    return {"machine": machine, "dtype": sweep["dtype"], "new_tokens": sweep["new_tokens"], "verify_steps": steps,
            "sweep": {"gammas": sorted({r["gamma"] for r in sweep["rows"]}), "repeats": sweep["repeats"],
                      "rows": sweep["rows"], "best": sweep["best"]},
            "draft": {"c": c, "steps": log["steps"], "loss_first": sum(losses[:5]) / 5, "loss_last": sum(losses[-5:]) / 5,
                      "floor": floor, "alpha_distilled": drafts["distilled"]["alpha"],
                      "alpha_untrained": drafts["untrained self-draft"]["alpha"],
                      "speedup_distilled": drafts["distilled"]["measured_speedup"],
                      "speedup_untrained": drafts["untrained self-draft"]["measured_speedup"],
                      "alpha_for_2x": reachable.get(easiest), "alpha_for_2x_gamma": easiest, "gamma_max": gammas[-1],
                      "perfect_gamma2": 3 / (2 * c + steps[3]), "perfect_gamma2_cost": 2 * c + steps[3]},
            "replay": {"gamma_max": gammas[-1], "summarise": best["summarise (input-grounded)"][0],
                       "edit_code": best["edit code (input-grounded)"][0], "rewrite": rewrite[0],
                       "rewrite_gamma": rewrite[1]}}


def appendix_summary(rec: dict) -> str:
    """Notebook 04a's closing note, from its record (``appendix_record``)."""
    d, rp, sweep = rec["draft"], rec["replay"], rec["sweep"]
    rb = sweep["best"]["rewrite (input-grounded)"]
    rtop = next(r for r in sweep["rows"] if r["workload"] == "rewrite (input-grounded)" and r["gamma"] == rb["measured"])
    need = (f"alpha of at least {d['alpha_for_2x']:.2f} (gamma {d['alpha_for_2x_gamma']} of 1..{d['gamma_max']}) at this c; "
            if d["alpha_for_2x"] is not None else "more than a perfect draft at this c; ")
    # the verdict names the answers it judges: the copying answer's best gamma (above) is far past 2x
    verdict = ("So on this machine neither a draft model nor another prompt-lookup setting brings the answers that are "
               "written in the model's own words (the chat answer, the summary, the code edit) to 2x; where the answer "
               f"copies its prompt, prompt lookup goes far past it ({rtop['measured_speedup']:.2f}x at its best gamma)."
               if max(rp["summarise"], rp["edit_code"]) < 2 and d["speedup_distilled"] < 2 else
               "At least one of the answers written in the model's own words reaches 2 tokens per pass or 2x here: "
               "see the cells above for which.")
    return f"""{rec['machine']}, float32, batch 1, greedy:

* **Draft cost:** a 4-layer early exit of the target costs c = {d['c']:.2f} target decode steps per drafted token.
* **Distillation:** {d['steps']} steps took the cross-entropy to the target from {d['loss_first']:.2f} to
  {d['loss_last']:.2f} nats (floor: {d['floor']:.2f}); on a chat answer the distilled draft reached alpha
  {d['alpha_distilled']:.2f} (the untrained early exit: {d['alpha_untrained']:.2f}) and ran at {d['speedup_distilled']:.2f}x plain
  decoding (gamma 2).
* **What 2x would take:** {need}a perfect draft at gamma 2 would give {d['perfect_gamma2']:.2f}x.
* **Prompt lookup's ceiling on abstractive answers:** at most {rp['summarise']:.2f} tokens per pass for the summary
  and {rp['edit_code']:.2f} for the code edit, over gamma 1..{rp['gamma_max']} and min_n 1..3, with verification free.
* **The best gamma, live:** for rewriting, gamma {rb['measured']} measured {rtop['measured_speedup']:.2f}x
  ({rtop['passes']} passes for the whole answer).

{verdict}"""

"""Exercises 7 and 10: verifying a speculative draft, and top-p (nucleus) filtering. They follow
``minillm.speculative.rejection_sample`` (Leviathan, Kalman, Matias 2023, Algorithm 1; Chen et al.
2023, Algorithm 2) and ``minillm.sampling.logits_to_probs`` (Holtzman et al. 2020, Sec. 3.1)."""

from __future__ import annotations

import torch

from ..sampling import SamplingParams, logits_to_probs
from ..speculative import acceptance_probability, rejection_sample, residual_distribution
from .checker import Case, Exercise, Failure, describe, first_match, number_problem, same_tensor, tensor_problem

# ---------------------------------------------------------------------------------------------
# 7. speculative_verify


def uniforms_for(seed: int, k: int) -> torch.Tensor:
    """The k uniforms ``rejection_sample`` draws for its acceptance tests from a generator seeded with
    ``seed`` (one ``torch.rand(())`` per draft, in order)."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.rand((), generator=g) for _ in range(k)]) if k else torch.zeros(0)


def reference_verify(draft_tokens, draft_probs, target_probs, uniforms, seed=None):
    """The package's answer: ``rejection_sample`` gives the number accepted (its uniforms are those of
    ``seed``); the next token's distribution is the package's residual, or target_probs[k] (bonus)."""
    k = len(draft_tokens)
    if seed is not None:
        n = rejection_sample(list(draft_tokens), draft_probs, target_probs, torch.Generator().manual_seed(seed))[1]
    else:  # a hand-made case with chosen uniforms: the same test, min(1, target / draft) > u
        n = next((i for i, x in enumerate(draft_tokens)
                  if float(uniforms[i]) >= acceptance_probability(target_probs[i], draft_probs[i], x)), k)
    nxt = target_probs[k] if n == k else residual_distribution(target_probs[n], draft_probs[n])
    return n, nxt


def _t(rows):
    return torch.tensor(rows, dtype=torch.float32)


def verify_cases() -> list[Case]:
    u = _t
    return [
        Case("a draft token the target gives no mass is rejected", (
            [2], _t([[0.1, 0.2, 0.7, 0.0]]), _t([[0.5, 0.5, 0.0, 0.0], [0.25] * 4]), u([0.3])),
            # residual max(0, target - draft) = [0.4, 0.3, 0, 0], normalised
            (0, _t([4 / 7, 3 / 7, 0.0, 0.0]))),
        Case("every draft accepted: the bonus token comes from target_probs[k]", (
            [1, 3], _t([[0.25, 0.5, 0.25, 0.0], [0.0, 0.5, 0.0, 0.5]]),
            _t([[0.25, 0.5, 0.25, 0.0], [0.0, 0.5, 0.0, 0.5], [0.1, 0.2, 0.3, 0.4]]), u([0.9, 0.9])),
            (2, _t([0.1, 0.2, 0.3, 0.4]))),
        Case("a draft the target likes more than the draft does is always accepted", (
            [0], _t([[0.2, 0.8, 0.0, 0.0]]), _t([[0.6, 0.4, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]]), u([0.99])),
            (1, _t([0.0, 0.0, 1.0, 0.0]))),
        Case("accepted with probability 1/2: u = 0.4 accepts, u = 0.6 rejects the second draft", (
            [0, 0], _t([[0.5, 0.5, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0]]),
            _t([[0.25, 0.25, 0.25, 0.25], [0.25, 0.25, 0.25, 0.25], [1.0, 0.0, 0.0, 0.0]]), u([0.4, 0.6])),
            # residual at the second draft: max(0, [.25, .25, .25, .25] - [.5, .5, 0, 0]) = [0, 0, .25, .25]
            (1, _t([0.0, 0.0, 0.5, 0.5]))),
        Case("prompt lookup (a one-hot draft) rejected: the residual is the target without that token", (
            [1], _t([[0.0, 1.0, 0.0, 0.0]]), _t([[0.5, 0.25, 0.25, 0.0], [0.25] * 4]), u([0.5])),
            (0, _t([2 / 3, 0.0, 1 / 3, 0.0]))),
    ]


def verify_random(g: torch.Generator) -> list[Case]:
    cases = []
    for i in range(4):
        k, V = int(torch.randint(1, 5, (), generator=g)), 12
        target = torch.softmax(3 * torch.randn(k + 1, V, generator=g), -1)
        draft = torch.softmax(target[:k].log() + torch.randn(k, V, generator=g), -1)  # a draft that is close
        tokens = [int(torch.multinomial(draft[j], 1, generator=g)) for j in range(k)]
        seed = int(torch.randint(0, 2**31, (), generator=g))
        # the reference runs rejection_sample itself, on the generator these uniforms come from
        cases.append(Case(f"random {i + 1} (k={k} drafts, V={V})", (tokens, draft, target, uniforms_for(seed, k)),
                          reference_kwargs={"seed": seed}))
    return cases


def _wrong_verify(draft_tokens, draft_probs, target_probs, uniforms, *, ratio="target/draft", normalise=True,
                  residual=True, bonus=True, count_rejected=False):
    """Verification with the switches of the typical mistakes."""
    k = len(draft_tokens)
    for i, x in enumerate(draft_tokens):
        p, q = float(target_probs[i, x]), float(draft_probs[i, x])
        a = min(1.0, (p / q) if ratio == "target/draft" else (q / p if p > 0 else float("inf")))
        if float(uniforms[i]) >= a:
            r = (target_probs[i] - draft_probs[i]).clamp_min(0) if residual else target_probs[i]
            return i + count_rejected, (r / r.sum() if normalise else r)
    return k, (target_probs[k] if bonus else target_probs[k - 1])


def judge_verify(case: Case, expected, got, args) -> Failure | None:
    n_exp, p_exp = expected
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        return Failure(describe(expected), describe(got), "return the pair (num_accepted, next_probs)")
    n, probs = got
    problem = number_problem(n, "num_accepted") or tensor_problem(probs, p_exp.shape, what="next_probs")
    if problem:
        return Failure(describe(expected), describe(got), problem)
    if int(n) == n_exp and same_tensor(probs, p_exp):
        return None
    tokens, draft, target, u = case.args
    k = len(tokens)

    def wrong(**kw):
        return lambda: _wrong_verify(tokens, draft, target, u, **kw)

    mutants = [
        (wrong(normalise=False), "the residual is not normalised: divide max(0, target_probs - draft_probs) "
                                 "by its sum"),
        (wrong(residual=False), "after a rejection draw from the residual max(0, target_probs - draft_probs), "
                                "normalised, not from target_probs: the draft already had its chance at those tokens"),
        (wrong(bonus=False), "every draft was accepted, so the step still emits one more token: the bonus, "
                             "from target_probs[k] (the row past the last draft)"),
        (wrong(ratio="draft/target"), "accept draft x with probability min(1, target_probs[x] / draft_probs[x]): "
                                      "the target's probability on top"),
        (wrong(count_rejected=True), "num_accepted counts the drafts kept, not the rejected one"),
    ]
    hint = first_match(got, mutants, lambda a, b: int(a[0]) == b[0] and same_tensor(a[1], b[1]))
    if hint is None and k and n_exp == k and int(n) == k and not same_tensor(probs, p_exp):
        hint = "every draft was accepted: next_probs is target_probs[k], the bonus token's distribution"
    if hint is None and (probs < 0).any():
        hint = "probabilities cannot be negative: clamp target_probs - draft_probs at 0"
    if hint is None and abs(float(probs.sum()) - 1) > 1e-4:
        hint = "next_probs should sum to 1"
    if hint is None and int(n) != n_exp:
        hint = ("accept draft i when uniforms[i] < min(1, target_probs[i, x] / draft_probs[i, x]); "
                "stop at the first rejection")
    return Failure(describe(expected), describe(got), hint or "compare with Leviathan et al. 2023, Algorithm 1")


VERIFY = Exercise(
    name="speculative_verify",
    signature=("speculative_verify(draft_tokens, draft_probs, target_probs, uniforms) "
               "-> (num_accepted, next_probs (V,))"),
    notebook="07_speculative_sampling.ipynb",
    follows="minillm.speculative.rejection_sample, acceptance_probability, residual_distribution",
    reference=reference_verify,
    forbidden=("minillm.speculative.rejection.rejection_sample", "minillm.speculative.rejection.residual_distribution",
               "minillm.speculative.rejection.acceptance_probability",
               "minillm.speculative.rejection.emitted_distribution"),
    hand_cases=verify_cases,
    random_cases=verify_random,
    judge=judge_verify,
)


# ---------------------------------------------------------------------------------------------
# 10. top_p_filter


def reference_top_p(probs, top_p):
    return logits_to_probs(probs.log(), SamplingParams(temperature=1.0, top_p=top_p))


def top_p_cases() -> list[Case]:
    p = _t([[0.5, 0.25, 0.125, 0.125]])
    return [
        Case("the token that crosses top_p is kept (top_p 0.6 needs 2 tokens)", (p, 0.6), _t([[2 / 3, 1 / 3, 0, 0]])),
        Case("top_p reached exactly by 2 tokens (0.5 + 0.25 = 0.75): no third", (p, 0.75), _t([[2 / 3, 1 / 3, 0, 0]])),
        Case("tokens not in order: the result stays in the input's order",
             (_t([[0.125, 0.5, 0.125, 0.25]]), 0.7), _t([[0, 2 / 3, 0, 1 / 3]])),
        Case("top_p 1 keeps every token", (p, 1.0), p.clone()),
        Case("a peaked row keeps only its top token; a batch of 2 rows", (
            _t([[0.0625, 0.875, 0.0625, 0.0], [0.125, 0.375, 0.0625, 0.4375]]), 0.5),
            _t([[0, 1, 0, 0], [0, 6 / 13, 0, 7 / 13]])),
    ]


def top_p_random(g: torch.Generator) -> list[Case]:
    cases = []
    for i in range(4):
        B, V = int(torch.randint(1, 4, (), generator=g)), int(torch.randint(5, 50, (), generator=g))
        probs = torch.softmax(2 * torch.randn(B, V, generator=g), -1)
        top_p = round(float(torch.rand((), generator=g)) * 0.9 + 0.05, 3)
        cases.append(Case(f"random {i + 1} (B={B}, V={V}, top_p={top_p})", (probs, top_p)))
    return cases


def judge_top_p(case: Case, expected, got, args) -> Failure | None:
    probs = case.args[0]
    problem = tensor_problem(got, probs.shape, torch.float32)
    if problem:
        return Failure(describe(expected), describe(got), problem)
    if same_tensor(got, expected):
        return None
    kept_exp, kept = (expected > 0).sum(-1), (got > 0).sum(-1)
    sorted_exp = expected.sort(-1, descending=True).values
    if (kept == kept_exp - 1).any() and (kept <= kept_exp).all():
        hint = ("one token too few: keep the token that crosses top_p (drop a token only when the tokens "
                "ranked above it already reach top_p: cumsum - p >= top_p)")
    elif (kept == kept_exp + 1).any() and (kept >= kept_exp).all():
        hint = "one token too many: once the tokens above it reach top_p (>=, not >), a token is dropped"
    elif same_tensor(got, sorted_exp):
        hint = "the result is in sorted order: scatter the kept probabilities back to their token ids"
    elif torch.equal(kept, kept_exp) and same_tensor(got / got.sum(-1, keepdim=True), expected):
        hint = "renormalise: divide the kept probabilities by their sum so each row sums to 1"
    else:
        r = int((~torch.isclose(got, expected, atol=1e-5, rtol=1e-4)).any(-1).nonzero()[0])
        hint = (f"row {r} keeps {int(kept[r])} tokens, the answer {int(kept_exp[r])}: add the row's probabilities "
                "from the most likely down; which token makes the sum reach top_p, and what happens to the rest?")
    return Failure(describe(expected), describe(got), hint)


TOP_P = Exercise(
    name="top_p_filter",
    signature="top_p_filter(probs (B, V), top_p) -> (B, V) float32, renormalised",
    notebook="10_top_p.ipynb",
    follows="minillm.sampling.logits_to_probs (temperature 1, top_p)",
    reference=reference_top_p,
    forbidden=("minillm.sampling.logits_to_probs",),
    hand_cases=top_p_cases,
    random_cases=top_p_random,
    judge=judge_top_p,
)

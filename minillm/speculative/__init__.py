"""Speculative decoding with rejection sampling (Leviathan et al. 2023; Chen et al. 2023): a cheap
proposer drafts tokens, the target verifies them in one forward, and the emitted tokens follow the
target's distribution exactly.

    rejection.py   the acceptance test, the residual distribution, the bonus token; tokens per pass
    proposers.py   prompt lookup (n-gram) and a draft model
    decode.py      the generation loop with KV-cache rollback; replay and predicted speedup
    draft.py       a draft model for the embedded target: an early exit, distilled
    analysis.py    acceptance per position, the alpha a speedup needs, replayed prompt lookup
    cli.py         ``python -m minillm distill-draft`` and ``generate --draft``

``bench spec`` (plain vs speculative decoding, predicted and measured) and its figures are in the lab:
``minillm.lab.spec``, ``minillm.lab.spec_plots``.
"""

from .decode import SpeculativeStats, predicted_speedup, replay_greedy, speculative_generate
from .draft import distill_draft, save_llama_checkpoint, self_draft
from .proposers import DraftModelProposer, NgramProposer
from .rejection import (acceptance_probability, draw, emitted_distribution, expected_tokens_per_pass,
                        leviathan_speedup, rejection_sample, residual_distribution)

__all__ = ["DraftModelProposer", "NgramProposer", "SpeculativeStats", "acceptance_probability", "distill_draft",
           "draw", "emitted_distribution", "expected_tokens_per_pass", "leviathan_speedup", "predicted_speedup",
           "rejection_sample", "replay_greedy", "residual_distribution", "save_llama_checkpoint", "self_draft",
           "speculative_generate"]

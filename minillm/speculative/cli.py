"""``python -m minillm distill-draft``, and the ``--draft`` option of ``generate`` (which ``bench spec``,
in ``minillm.lab.spec``, shares)."""

from __future__ import annotations

import sys

from ..data import CALIBRATION_PLAY, play_text
from ..loading import load_model
from ..options import add_model_args, at_least, check_model_path, load, print_json
from ..files import check_output_path
from .draft import distill_draft, save_llama_checkpoint
from .proposers import DraftModelProposer, NgramProposer


def _not_a_draft(path: str, why: Exception) -> ValueError:
    return ValueError(f"draft: {path!r} is neither 'ngram' nor a model minillm can load ({why}); give "
                      "'ngram' or a folder written by `python -m minillm distill-draft --out PATH`")


def check_draft(path: str) -> None:
    """Refuse, before the target is loaded, a ``--draft`` path that cannot be a model."""
    try:
        check_model_path(path, "--draft")
    except ValueError as e:
        raise _not_a_draft(path, e) from None


def load_draft(args, model):
    """The draft model at ``args.draft``, checked to share the target's vocabulary."""
    check_draft(args.draft)
    try:
        draft, _ = load_model(args.draft, dtype=args.dtype, device=model.device, n_shards=args.shards)
    except ValueError as e:  # ModelFileError included
        raise _not_a_draft(args.draft, e) from None
    if draft.config.vocab_size != model.config.vocab_size:
        raise ValueError(f"draft: {args.draft} has a vocabulary of {draft.config.vocab_size}, "
                         f"the target {model.config.vocab_size}; the draft must share the tokenizer")
    return draft


def make_proposer(args, model, ctx: int):
    """``--draft ngram`` (prompt lookup) or a ``DraftModelProposer`` over the draft model at that path."""
    if args.draft == "ngram":
        return NgramProposer(model.config.vocab_size)
    return DraftModelProposer(load_draft(args, model), ctx)


def cmd_distill_draft(args) -> int:
    check_output_path(args.out, "--out", folder=True, sources=[args.model] if args.model else ())
    model, tokenizer = load(args)
    if args.layers >= model.config.n_layers:
        raise ValueError(f"layers: a draft needs fewer layers than the target's {model.config.n_layers}")
    draft, log = distill_draft(model, tokenizer.encode(play_text(CALIBRATION_PLAY)), n_layers=args.layers,
                               steps=args.steps, progress=not args.json)
    save_llama_checkpoint(draft, args.out)
    report = {"out": args.out, **{k: v for k, v in log.items() if k != "losses"},
              "first_loss": log["losses"][0], "last_loss": sum(log["losses"][-20:]) / len(log["losses"][-20:])}
    if args.json:
        print_json(report)
        return 0
    print(f"wrote {args.out}: {args.layers} layers, {args.steps} steps in {log['seconds']:.0f} s, "
          f"loss {report['first_loss']:.2f} -> {report['last_loss']:.2f} (mean of the last 20 steps); "
          f"measure it with: python -m minillm bench spec --draft {args.out}", file=sys.stdout)
    return 0


def register(sub) -> None:
    """Add ``distill-draft`` under ``sub``."""
    dd = sub.add_parser("distill-draft", help="build a draft model for speculative decoding: the target's first "
                        "layers, distilled on the target's own distributions (a few minutes on a CPU)")
    dd.add_argument("--out", required=True, help="folder to write (config.json + model.safetensors; created "
                    "if missing, inside an existing folder)")
    dd.add_argument("--layers", type=at_least(1), default=4)
    dd.add_argument("--steps", type=at_least(1), default=300)
    add_model_args(dd)
    dd.set_defaults(func=cmd_distill_draft)

"""How one step's tokens become the input of one ``Decoder.forward`` on the paged cache.

``pack_flat`` (the default, vLLM V1's layout): every scheduled token side by side, (1, N), one segment per
sequence, so the linear layers compute no padding. ``pack_rows`` (for "indexed" and "gather"): B rows of T
tokens, -1 positions marking padding, T chosen by the cost ``B * T * c_token + B * S * c_key``
(``choose_row_width``); ``pack_rows_naive``, one row per sequence padded to the longest span, is its baseline.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

KEY_COST = 0.05  # c_key / c_token in token-rows per key position of a row (docs/paged.md: why 0.05)


@dataclass
class Rows:
    """One forward's inputs: ``seq_ids`` (B,) the sequence of each row, ``tokens`` and ``input_pos`` (B, T)
    int64 (padding: token 0, position -1), ``last`` {seq_id: (row, column)} of each sequence's last token.
    ``widths``: None for rectangular rows; for one flat row (B = 1) the tokens of each segment, and
    ``seq_ids`` then names each segment's sequence."""

    seq_ids: list[int]
    tokens: torch.Tensor
    input_pos: torch.Tensor
    last: dict[int, tuple[int, int]]
    widths: list[int] | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.tokens.shape)

    def logits_indices(self, seq_ids) -> torch.Tensor:
        """(N,) int64 flat indices (row * T + column) of the last tokens of ``seq_ids`` (``logits_indices=``)."""
        T = self.tokens.shape[1]
        return torch.tensor([self.last[s][0] * T + self.last[s][1] for s in seq_ids], dtype=torch.long,
                            device=self.tokens.device)


def choose_row_width(span_lengths: list[int], max_seq_len: int, key_cost: float = KEY_COST) -> int:
    """The row width T minimizing ``rows(T) * (T + key_cost * max_seq_len)`` over powers of two up to the
    longest span (and the longest span itself); max_seq_len: the longest sequence after the step (S)."""
    longest = max(span_lengths)
    widths = sorted({1 << k for k in range(longest.bit_length()) if 1 << k <= longest} | {longest})
    return min(widths, key=lambda T: sum(-(-n // T) for n in span_lengths) * (T + key_cost * max_seq_len))


def _check(spans) -> None:
    if not spans or any(not ids for _, _, ids in spans):
        raise ValueError("spans: give at least one span, each with at least one token")


def _to_rows(cut: list, width: int, device) -> Rows:
    """Rows of ``width`` tokens, one per (seq_id, start, token_ids) of ``cut``, padded with -1 positions."""
    tokens = torch.zeros((len(cut), width), dtype=torch.long)
    input_pos = torch.full((len(cut), width), -1, dtype=torch.long)
    last = {}
    for b, (seq_id, start, ids) in enumerate(cut):
        tokens[b, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        input_pos[b, :len(ids)] = torch.arange(start, start + len(ids))
        last[seq_id] = (b, len(ids) - 1)
    return Rows([s for s, _, _ in cut], tokens.to(device), input_pos.to(device), last)


def pack_rows(spans: list[tuple[int, int, list[int]]], max_seq_len: int, device="cpu",
              width: int | None = None) -> Rows:
    """Pack spans (seq_id, first position, new token ids) into rows of ``width`` tokens (default:
    ``choose_row_width``), ordered by where each row ends so that the "bucketed" groups are consecutive rows
    (a sequence's rows stay in position order). Raises ValueError for no spans or an empty span."""
    _check(spans)
    width = width or choose_row_width([len(ids) for _, _, ids in spans], max_seq_len)
    cut = [(s, start + a, ids[a:a + width]) for s, start, ids in spans for a in range(0, len(ids), width)]
    return _to_rows(sorted(cut, key=lambda row: row[1] + len(row[2])), width, device)


def pack_flat(spans: list[tuple[int, int, list[int]]], device="cpu") -> Rows:
    """Every span's tokens in one flat row (1, N), one segment per sequence, ordered by width, then by where
    it ends, so that the cache's groups are consecutive tokens.
    Raises ValueError for no spans, an empty span, or two spans of one sequence."""
    _check(spans)
    if len({s for s, _, _ in spans}) != len(spans):
        raise ValueError("spans: a flat row takes one span per sequence; join a sequence's spans first")
    spans = sorted(spans, key=lambda span: (len(span[2]), span[1] + len(span[2])))
    widths = [len(ids) for _, _, ids in spans]
    tokens = [t for _, _, ids in spans for t in ids]
    input_pos = [p for _, start, ids in spans for p in range(start, start + len(ids))]
    last = {s: (0, end - 1) for (s, _, _), end in zip(spans, itertools.accumulate(widths))}
    return Rows([s for s, _, _ in spans], torch.tensor([tokens], dtype=torch.long, device=device),
                torch.tensor([input_pos], dtype=torch.long, device=device), last, widths)


def pack_rows_naive(spans: list[tuple[int, int, list[int]]], max_seq_len: int = 0, device="cpu") -> Rows:
    """The baseline: one row per sequence, every row padded to the longest span."""
    _check(spans)
    return _to_rows(spans, max(len(ids) for _, _, ids in spans), device)

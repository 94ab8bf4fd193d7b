"""How a ``Tokenizer`` is built from a model file: GGUF's ``tokenizer.ggml.*`` metadata or a Hugging Face folder's
tokenizer.json, into a ``tiktoken.Encoding`` (``minillm.tokenizer`` says why token ids serve as tiktoken's ranks).
Each builder takes the class to build (``Tokenizer``, whose ``from_gguf`` / ``from_hf_folder`` / ``from_vocab`` call
them)."""

from __future__ import annotations

import json
from pathlib import Path

import tiktoken

# GPT-2's pre-tokenizer (OpenAI's encoder.py)
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# llama.cpp's "smollm" pre-tokenizer (= the original tokenizer.json: Digits(individual_digits)
# then ByteLevel): every digit is its own piece, and whitespace before a digit stays one piece.
SMOLLM_PATTERN = r"""\p{N}|'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?[^\s\p{L}\p{N}]+|\s+(?=\p{N})|\s+(?!\S)|\s+"""
PATTERNS = {"gpt2": GPT2_PATTERN, "smollm": SMOLLM_PATTERN}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable unicode characters: printable
    Latin-1 bytes map to themselves, the others to chr(256 + n) in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, n = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + n)
            n += 1
    return table


def _hf_pretokenizer(pre: dict | None, path) -> str:
    """The regex of a tokenizer.json pre-tokenizer that tiktoken can reproduce exactly.

    Raises:
        ValueError: any other pre-tokenizer.
    """
    def byte_level(p, use_regex):
        return (p.get("type") == "ByteLevel" and not p.get("add_prefix_space", False)
                and p.get("use_regex", True) == use_regex)

    if pre and byte_level(pre, True):
        return "gpt2"
    parts = (pre or {}).get("pretokenizers", []) if (pre or {}).get("type") == "Sequence" else []
    if len(parts) == 2 and parts[0].get("type") == "Digits" and parts[0].get("individual_digits") \
            and byte_level(parts[1], True):
        return "smollm"
    if len(parts) == 2 and parts[0].get("type") == "Split" and "Regex" in (parts[0].get("pattern") or {}) \
            and parts[0].get("behavior") == "Isolated" and not parts[0].get("invert") and byte_level(parts[1], False):
        return parts[0]["pattern"]["Regex"]
    raise ValueError(f"{path}: pre-tokenizer {json.dumps(pre)[:200]} is not supported; minillm reproduces GPT-2's "
                     "byte-level regex, digit splitting + byte level, and a single Split regex + byte level")


def from_vocab(cls, tokens: list[str], special_ids: list[int], pre: str = "gpt2", name: str = "minillm",
               merges: list[str] | None = None, plain_ids: list[int] = (), **kwargs) -> "Tokenizer":
    """Build from a byte-level vocabulary (token strings in GPT-2's unicode form, index = id).

    Args:
        tokens: every token, in id order; special tokens are those listed in ``special_ids``.
        special_ids: ids of control tokens ("<|im_end|>", ...), matched only when allowed.
        pre: pre-tokenizer name ("gpt2", "smollm") or a regular expression.
        merges: the merge list ("a b" strings), to check that merged tokens' ids follow it.
        plain_ids: added tokens (among ``special_ids``) that match in any text, like Hugging
            Face's non-special added tokens.

    Raises:
        ValueError: a token that is not byte-level, or ids that do not follow merge order.
    """
    u2b = {c: b for b, c in bytes_to_unicode().items()}
    if merges is not None:
        ids = {t: i for i, t in enumerate(tokens)}
        merged = [ids.get(m.replace(" ", "", 1)) for m in merges]
        if None in merged or any(a >= b for a, b in zip(merged, merged[1:])):
            raise ValueError("merges: merged token ids do not follow the merge list, so token ids cannot "
                             "serve as tiktoken ranks")
    specials = {tokens[i]: i for i in special_ids}
    ranks = {}
    for i, tok in enumerate(tokens):
        if i in special_ids:
            continue
        try:
            ranks[bytes(u2b[c] for c in tok)] = i
        except KeyError:
            raise ValueError(f"token {i} ({tok!r}) is not a byte-level BPE token") from None
    # bytes the vocabulary lacks (control bytes, bytes never valid in UTF-8) get ranks past the
    # vocabulary and are dropped after encoding, as the Hugging Face tokenizer drops them
    extra = len(tokens)
    for b in range(256):
        if bytes([b]) not in ranks:
            ranks[bytes([b])] = extra
            extra += 1
    pattern = PATTERNS.get(pre, pre)
    enc = tiktoken.Encoding(name=name, pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials)
    tok = cls(enc, len(tokens), **kwargs)
    tok.plain_added = {tokens[i] for i in plain_ids}
    return tok


def from_gguf(cls, reader) -> "Tokenizer":
    """From a GGUF reader's ``tokenizer.ggml.*`` metadata (model "gpt2" only).

    Raises:
        ValueError: a tokenizer model other than byte-level BPE, or an unknown pre-tokenizer.
    """
    f = reader.fields
    model = f["tokenizer.ggml.model"].contents()
    if model != "gpt2":
        raise ValueError(f"tokenizer.ggml.model: {model!r} is not supported (byte-level BPE 'gpt2' only)")
    tokens = f["tokenizer.ggml.tokens"].contents()
    types = f["tokenizer.ggml.token_type"].contents()
    pre = f["tokenizer.ggml.pre"].contents() if "tokenizer.ggml.pre" in f else "gpt2"
    if pre not in PATTERNS:
        raise ValueError(f"tokenizer.ggml.pre: pre-tokenizer {pre!r} is not supported; known: {list(PATTERNS)}")
    special_ids = [i for i, t in enumerate(types) if t == 3]  # CONTROL tokens

    def get(key):
        return f[key].contents() if key in f else None

    merges = f["tokenizer.ggml.merges"].contents() if "tokenizer.ggml.merges" in f else None
    return from_vocab(
        cls, tokens, special_ids, pre=pre, name="gguf", merges=merges,
        eos_id=get("tokenizer.ggml.eos_token_id"), bos_id=get("tokenizer.ggml.bos_token_id"),
        chat_template=get("tokenizer.chat_template"),
    )


def from_hf_folder(cls, folder: str | Path) -> "Tokenizer | None":
    """From a checkpoint folder's tokenizer.json (byte-level BPE); None if there is none.

    Raises:
        ValueError: a tokenizer.json minillm cannot reproduce exactly (not BPE, a pre-tokenizer
            other than GPT-2's byte-level regex, digit splitting + byte level, or one Split regex
            + byte level; ids out of merge order; a prefix space).
    """
    folder = Path(folder)
    path = folder / "tokenizer.json"
    if not path.is_file():
        return None
    tj = json.loads(path.read_text(encoding="utf-8"))
    model = tj.get("model") or {}
    if model.get("type") != "BPE":
        raise ValueError(f"{path}: tokenizer model {model.get('type')!r} is not supported (byte-level BPE only)")
    pre = _hf_pretokenizer(tj.get("pre_tokenizer"), path)
    vocab = dict(model["vocab"])
    added = tj.get("added_tokens", [])
    for a in added:
        vocab[a["content"]] = a["id"]
    tokens = [None] * (max(vocab.values()) + 1)
    for t, i in vocab.items():
        tokens[i] = t
    if any(t is None for t in tokens):
        raise ValueError(f"{path}: token ids are not contiguous")
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.is_file() else {}
    template = cfg.get("chat_template")
    if template is None and (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    ids = {t: i for i, t in enumerate(tokens)}

    def tok_id(key):
        v = cfg.get(key)
        v = v.get("content") if isinstance(v, dict) else v
        return ids.get(v)

    return from_vocab(cls, tokens, [a["id"] for a in added], pre=pre, name=folder.name, merges=merges,
                          plain_ids=[a["id"] for a in added if not a.get("special")],
                          eos_id=tok_id("eos_token"), bos_id=tok_id("bos_token"), chat_template=template)

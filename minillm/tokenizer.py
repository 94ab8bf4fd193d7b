"""The tokenizer: a ``tiktoken.Encoding`` built from the model file's vocabulary and merges.

SmolLM2 uses GPT-2's byte-level BPE (Radford et al. 2019; Sennrich et al. 2016): text is split by a
regular expression (the pre-tokenizer), each piece's UTF-8 bytes are mapped to printable characters
(``bytes_to_unicode``), and merges are applied by rank. tiktoken merges the adjacent pair whose
concatenation has the lowest rank, which equals merge-list order when every merged token's id
follows the merge list (checked in ``from_vocab``), so token ids serve as tiktoken ranks.

Special tokens in user text are plain text unless the caller allows them: a chat message cannot
close its own turn by typing "<|im_end|>".
"""

from __future__ import annotations

import codecs
import json
import re
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


class Tokenizer:
    """Byte-level BPE through tiktoken, with the model's special tokens and chat template.

    Attributes:
        encoding: the ``tiktoken.Encoding``.
        eos_id, bos_id: ids of the end/beginning-of-sequence tokens (None if the model has none).
        special_tokens: {text: id}.
        chat_template: the model's Jinja chat template, or None.
    """

    def __init__(self, encoding: tiktoken.Encoding, vocab_size: int, eos_id: int | None = None, bos_id: int | None = None,
                 chat_template: str | None = None):
        self.encoding = encoding
        self.vocab_size = vocab_size
        for name, i in (("eos_id", eos_id), ("bos_id", bos_id)):
            if i is not None and not 0 <= i < vocab_size:
                raise ValueError(f"{name}: {i} is outside the vocabulary of {vocab_size} tokens")
        self.eos_id, self.bos_id = eos_id, bos_id
        self.special_tokens = {t: encoding.encode_single_token(t) for t in encoding.special_tokens_set}
        self.chat_template = chat_template
        self.plain_added: set[str] = set()  # added tokens matched even in plain text

    # -- construction ---------------------------------------------------------------------------
    @classmethod
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

    @classmethod
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
        return cls.from_vocab(
            tokens, special_ids, pre=pre, name="gguf", merges=merges,
            eos_id=get("tokenizer.ggml.eos_token_id"), bos_id=get("tokenizer.ggml.bos_token_id"),
            chat_template=get("tokenizer.chat_template"),
        )

    @classmethod
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

        return cls.from_vocab(tokens, [a["id"] for a in added], pre=pre, name=folder.name, merges=merges,
                              plain_ids=[a["id"] for a in added if not a.get("special")],
                              eos_id=tok_id("eos_token"), bos_id=tok_id("bos_token"), chat_template=template)

    # -- use --------------------------------------------------------------------------------------
    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        """Text -> token ids. Special-token text is plain text unless ``allow_special``.

        Raises:
            ValueError: text that is not valid Unicode (lone surrogates).
        """
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"text: not valid Unicode ({e.reason} at index {e.start}); fix the input") from None
        if allow_special:
            ids = self.encoding.encode(text, allowed_special="all")
        else:
            ids = self.encoding.encode(text, allowed_special=self.plain_added, disallowed_special=())
        return [i for i in ids if i < self.vocab_size]

    def _special_text(self, token_id: int | None) -> str:
        return next((t for t, i in self.special_tokens.items() if i == token_id), "")

    def decode(self, ids: list[int]) -> str:
        """Token ids -> text (invalid UTF-8 becomes U+FFFD)."""
        return self.encoding.decode(list(ids), errors="replace")

    def stream_decoder(self):
        """A function ``feed(token_id) -> str`` that returns the text completed by each new token
        (a multi-byte character split across tokens comes out once its last byte arrives)."""
        utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        return lambda token_id: utf8.decode(self.encoding.decode_single_token_bytes(token_id))

    def encode_chat(self, text: str) -> list[int]:
        """The ids of one user message in the chat template, ready for the assistant's answer."""
        return self.apply_chat_template([{"role": "user", "content": text}])

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Render the model's chat template (ChatML for SmolLM2) into token ids.

        The template is rendered with Jinja like Hugging Face's ``apply_chat_template``; the
        special tokens the *template* writes become special ids, while the messages' content is
        always encoded as plain text.

        Args:
            messages: [{"role": "system"|"user"|"assistant", "content": str}, ...].

        Raises:
            ValueError: the model has no chat template, or a message lacks role/content.
        """
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        if not self.chat_template:
            raise ValueError("this model has no chat template; pass a plain prompt instead of --chat")
        placeholders, values, safe = [], [], []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"messages[{i}]: needs string 'role' and 'content', got {m!r}")
            if any(c in m["role"] + m["content"] for c in "\uE000\uE001"):
                raise ValueError(f"messages[{i}]: contains U+E000/U+E001, reserved by minillm's chat template")
            # content goes through the template as a placeholder (private-use characters), so that
            # nothing the user wrote can become a special token; roles steer the template's logic,
            # so they stay as they are and may not hold special-token text
            if any(sp in m["role"] for sp in self.special_tokens):
                raise ValueError(f"messages[{i}]: role {m['role']!r} contains a special token")
            content = f"\uE000{i}\uE001"
            placeholders.append(content)
            values.append(m["content"])
            safe.append({**m, "content": content})
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        rendered = env.from_string(self.chat_template).render(
            messages=safe, add_generation_prompt=add_generation_prompt,
            bos_token=self._special_text(self.bos_id), eos_token=self._special_text(self.eos_id),
        )
        specials = sorted(self.special_tokens, key=len, reverse=True)
        ids = []
        for part in re.split("(" + "|".join(map(re.escape, specials)) + ")", rendered):
            if part in self.special_tokens:
                ids.append(self.special_tokens[part])
            elif part:
                for ph, value in zip(placeholders, values):
                    part = part.replace(ph, value)
                ids.extend(self.encode(part))
        return ids

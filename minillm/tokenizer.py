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
import re
from pathlib import Path

import tiktoken

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

    # -- construction (the builders read model files: minillm.formats.tokenizer_files) -----------------
    @classmethod
    def from_vocab(cls, tokens: list[str], special_ids: list[int], pre: str = "gpt2", name: str = "minillm",
                   merges: list[str] | None = None, plain_ids: list[int] = (), **kwargs) -> "Tokenizer":
        """From a byte-level vocabulary in id order (``tokenizer_files.from_vocab`` says how)."""
        from .formats import tokenizer_files

        return tokenizer_files.from_vocab(cls, tokens, special_ids, pre, name, merges, plain_ids, **kwargs)

    @classmethod
    def from_gguf(cls, reader) -> "Tokenizer":
        """From a GGUF reader's ``tokenizer.ggml.*`` metadata (``tokenizer_files.from_gguf``)."""
        from .formats import tokenizer_files

        return tokenizer_files.from_gguf(cls, reader)

    @classmethod
    def from_hf_folder(cls, folder: str | Path) -> "Tokenizer | None":
        """From a checkpoint folder's tokenizer.json, or None if there is none (``tokenizer_files.from_hf_folder``)."""
        from .formats import tokenizer_files

        return tokenizer_files.from_hf_folder(cls, folder)

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

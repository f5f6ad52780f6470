"""The checkpoint's own tokenizer (Hugging Face tokenizer stack), plus incremental detokenization for streaming.

Encoding, decoding and chat templates are delegated to transformers' fast tokenizer loaded from the checkpoint
directory (tokenizer.json + tokenizer_config.json; the chat template from either tokenizer_config.json or
chat_template.jinja), so text round-trips exactly as with the checkpoint's tokenizer.
"""

from __future__ import annotations

import os
from pathlib import Path

REPLACEMENT_CHAR = "\ufffd"


class Tokenizer:
    def __init__(self, path: str | os.PathLike, extra_eos_token_ids: list[int] | None = None):
        from transformers import AutoTokenizer

        from .model.loader import resolve_model_path

        root = resolve_model_path(path)
        if not (root / "tokenizer.json").is_file() and not (root / "tokenizer_config.json").is_file():
            raise FileNotFoundError(f"{root}: no tokenizer.json / tokenizer_config.json")
        self.path = Path(root)
        self.hf = AutoTokenizer.from_pretrained(str(root), local_files_only=True)
        eos = list(extra_eos_token_ids or [])
        if self.hf.eos_token_id is not None:
            eos.append(self.hf.eos_token_id)
        self.eos_token_ids: list[int] = list(dict.fromkeys(eos))  # ordered, unique
        self.bos_token_id = self.hf.bos_token_id
        self.vocab_size = len(self.hf)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Render with the checkpoint's template, then encode without adding BOS again (the template has it)."""
        if not self.has_chat_template:
            raise ValueError(f"{self.path}: the tokenizer has no chat template")
        text = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        return self.encode(text, add_special_tokens=False)

    def token_strings(self, ids: list[int]) -> list[str]:
        """Each id decoded alone (for the debug view): may show partial UTF-8 as the replacement character."""
        return [self.hf.decode([i], skip_special_tokens=False) for i in ids]

    def detokenizer(self, prompt_ids: list[int]) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, prompt_ids)


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas that never split a UTF-8 character.

    Decodes a short window ``ids[prefix:]`` and emits what it adds beyond ``ids[prefix:read]``; a window that
    ends in U+FFFD (an incomplete byte sequence) is held back until the next token completes it. The window
    starts a few tokens into the prompt so tokenizers that strip a leading space (SentencePiece) decode the
    first generated word correctly.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], context: int = 5):
        self.tok = tokenizer
        self.ids = list(prompt_ids[-context:])
        self.prefix = 0
        self.read = len(self.ids)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix_text = self.tok.decode(self.ids[self.prefix:self.read])
        new_text = self.tok.decode(self.ids[self.prefix:])
        if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT_CHAR):
            self.prefix, self.read = self.read, len(self.ids)
            return new_text[len(prefix_text):]
        return ""

    def flush(self) -> str:
        """At the end of a sequence: whatever is still held back (possibly a lone replacement character)."""
        prefix_text = self.tok.decode(self.ids[self.prefix:self.read])
        new_text = self.tok.decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return new_text[len(prefix_text):]

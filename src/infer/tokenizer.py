"""The checkpoint's own tokenizer (Hugging Face tokenizer stack), plus incremental detokenization for streaming.

Encoding, decoding and chat templates are delegated to transformers' fast tokenizer loaded from the checkpoint
directory (tokenizer.json + tokenizer_config.json; the chat template from either tokenizer_config.json or
chat_template.jinja), so text round-trips exactly as with the checkpoint's tokenizer.

A GGUF checkpoint carries its tokenizer as metadata (tokens, merges, special ids, chat template); transformers
converts it (``gguf_file=``), which takes seconds for a real vocabulary, so the converted tokenizer is saved once
under ``$XDG_CACHE_HOME/infer/tokenizers`` (default ~/.cache), keyed by the file's path, size and mtime and the
transformers version. A directory holding a GGUF *and* tokenizer.json uses tokenizer.json.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import tokenizers

from .cachedir import cache_dir

REPLACEMENT_CHAR = "\ufffd"
_SIDECAR = "infer_gguf.json"  # beside the cached tokenizer: the source file and its EOS ids


def tokenizer_cache_dir() -> Path:
    return cache_dir("tokenizers")


def _load_converted(cached: Path):
    """A converted tokenizer saved by ``_gguf_tokenizer``. Its class is the generic fast tokenizer (a tokenizer.json),
    which is loaded directly: AutoTokenizer would resolve to the same class after importing the configuration of
    every model family transformers knows (~1 s of a warm start)."""
    name = json.loads((cached / "tokenizer_config.json").read_text()).get("tokenizer_class")
    if name in ("TokenizersBackend", "PreTrainedTokenizerFast"):
        from transformers import PreTrainedTokenizerFast as cls
    else:
        from transformers import AutoTokenizer as cls
    return cls.from_pretrained(str(cached), local_files_only=True)


def _gguf_tokenizer(file: Path):
    """(transformers tokenizer, EOS ids from the metadata) for a GGUF file, through the cache when possible."""
    import transformers

    st = file.stat()
    key = f"{file.resolve()}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}"
    cached = tokenizer_cache_dir() / hashlib.sha256(key.encode()).hexdigest()[:32]
    if cached.is_dir():
        try:
            eos = json.loads((cached / _SIDECAR).read_text())["eos_token_ids"]
            return _load_converted(cached), eos
        except Exception as e:  # a damaged entry (whatever it raises): say so, convert again, overwrite it
            warnings.warn(f"cached tokenizer {cached} is damaged ({type(e).__name__}: {e}); converting the GGUF's "
                          "tokenizer again", RuntimeWarning, stacklevel=3)
    from .model.gguf import GGUFCheckpoint

    meta = GGUFCheckpoint(file)
    if meta.field("tokenizer.ggml.model") is None:
        raise FileNotFoundError(f"{file}: the GGUF carries no tokenizer (no tokenizer.ggml.* metadata); "
                                "pass a tokenizer directory")
    from transformers import AutoTokenizer

    try:
        hf = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name, local_files_only=True)
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{file}: transformers cannot build a tokenizer from this GGUF ({e})") from None
    if not getattr(hf, "chat_template", None) and meta.field("tokenizer.chat_template"):
        hf.chat_template = meta.field("tokenizer.chat_template")  # older transformers drop it
    eos = meta.eos_token_ids()
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=cached.parent))
    except OSError:
        return hf, eos  # no writable cache: work uncached
    try:  # write a temporary sibling, then rename: a concurrent reader never sees half an entry
        hf.save_pretrained(str(tmp))
        (tmp / _SIDECAR).write_text(json.dumps({"source": str(file.resolve()), "eos_token_ids": eos}))
        shutil.rmtree(cached, ignore_errors=True)
        os.replace(tmp, cached)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return hf, eos


# the names transformers' chat renderer sets itself (its arguments, and the template's messages): a template kwarg
# of one of them would clash with it, or change how the chat is rendered rather than what the template sees
_RENDERER_OWNS = frozenset(("conversation", "conversations", "messages", "tools", "documents", "chat_template",
                            "add_generation_prompt", "continue_final_message", "tokenize", "sanitize_control_tokens",
                            "padding", "truncation", "max_length", "return_tensors", "return_dict",
                            "return_assistant_tokens_mask", "tokenizer_kwargs"))


def check_template_kwargs(kwargs: dict | None) -> None:
    """ValueError naming the keys of ``kwargs`` (a chat template's extra variables) that are not the template's to
    set."""
    if kwargs is None:
        return
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise ValueError("chat_template_kwargs must map variable names to values")
    if clash := sorted(k for k in kwargs if k in _RENDERER_OWNS):
        raise ValueError(f"chat_template_kwargs cannot set {', '.join(map(repr, clash))}: the renderer sets "
                         f"{'it' if len(clash) == 1 else 'them'} (give messages, tools and add_generation_prompt as "
                         "the request's own fields)")


class Tokenizer:
    def __init__(self, path: str | os.PathLike, extra_eos_token_ids: list[int] | None = None):
        from .model.gguf import gguf_file_of
        from .model.loader import resolve_model_path

        root = resolve_model_path(path)
        self.path = Path(root)
        eos = list(extra_eos_token_ids or [])
        if root.is_dir() and ((root / "tokenizer.json").is_file() or (root / "tokenizer_config.json").is_file()):
            from transformers import AutoTokenizer

            self.hf = AutoTokenizer.from_pretrained(str(root), local_files_only=True)
        elif (gguf_file := gguf_file_of(root)) is not None:
            self.hf, gguf_eos = _gguf_tokenizer(gguf_file)
            eos += gguf_eos
        else:
            raise FileNotFoundError(f"{root}: no tokenizer.json / tokenizer_config.json (and no .gguf file)")
        if self.hf.eos_token_id is not None:
            eos.append(self.hf.eos_token_id)
        self.eos_token_ids: list[int] = list(dict.fromkeys(eos))  # ordered, unique
        self.bos_token_id = self.hf.bos_token_id
        self.vocab_size = len(self.hf)
        # The Rust tokenizer's own decode where transformers' adds nothing to it (a fast tokenizer without the
        # clean-up of tokenization spaces): transformers' wrapper is ~25 us of Python a call, and streaming decodes
        # twice a generated token (IncrementalDetokenizer)
        raw = getattr(self.hf, "_tokenizer", None)
        self._raw_decode = raw.decode if isinstance(raw, tokenizers.Tokenizer) and \
            not getattr(self.hf, "clean_up_tokenization_spaces", True) else None

    def encode(self, text: str, add_special_tokens: bool = True, split_special_tokens: bool = False) -> list[int]:
        """``split_special_tokens``: a special token's text in ``text`` is plain text (llama.cpp's parse_special
        false), not that token."""
        if split_special_tokens:
            return self.hf.encode(text, add_special_tokens=add_special_tokens, split_special_tokens=True)
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self._raw_decode is not None:
            return self._raw_decode(ids, skip_special_tokens=skip_special_tokens)
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, tools: list[dict] | None = None,
                            chat_template: str | None = None, template_kwargs: dict | None = None) -> list[int]:
        """Render with the checkpoint's template (or ``chat_template``, a Jinja template, as vLLM's ``LLM.chat``
        takes one), then encode without adding BOS again (the template has it). ``continue_final_message``: the
        last message (the assistant's, begun) is left open, so the reply continues it (transformers' flag; no new
        turn is opened then). ``tools``: OpenAI's function definitions, given to the template (which decides what
        the model sees of them; SmolLM2's shows none). ``template_kwargs``: more variables for the template (vLLM's
        ``chat_template_kwargs``, e.g. a reasoning model's ``enable_thinking``); ValueError for one the renderer sets
        itself."""
        check_template_kwargs(template_kwargs)
        if not self.has_chat_template and chat_template is None:
            raise ValueError(f"{self.path}: the tokenizer has no chat template")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message continues the last message: add_generation_prompt must be false")
        text = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                           continue_final_message=continue_final_message, tools=tools or None,
                                           chat_template=chat_template, **(template_kwargs or {}))
        return self.encode(text, add_special_tokens=False)

    def use_chat_template(self, template: str) -> None:
        """Replace the checkpoint's chat template with ``template`` (Jinja; vLLM's ``--chat-template``); ValueError
        with the template engine's message if it cannot render a conversation."""
        try:
            self.hf.apply_chat_template([{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                                         {"role": "assistant", "content": "a"}, {"role": "user", "content": "u"}],
                                        tokenize=False, add_generation_prompt=True, chat_template=template)
        except Exception as e:  # noqa: BLE001 - jinja2's syntax and runtime errors, and the template's own raises
            raise ValueError(f"the chat template cannot render a conversation: {type(e).__name__}: {e}") from None
        self.hf.chat_template = template

    def shows_tools(self) -> bool:
        """Whether the chat template shows the model the tools it is given (a probe function's name in the text)."""
        probe = "infer_probe_function_5f2c"
        tools = [{"type": "function", "function": {"name": probe, "description": "probe", "parameters": {
            "type": "object", "properties": {}}}}]
        try:
            text = self.hf.apply_chat_template([{"role": "user", "content": "hi"}], tools=tools, tokenize=False,
                                               add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - a template that fails on tools does not show them
            return False
        return probe in text

    def token_strings(self, ids: list[int]) -> list[str]:
        """Each id decoded alone (for the debug view): may show partial UTF-8 as the replacement character."""
        return [self.hf.decode([i], skip_special_tokens=False) for i in ids]

    def detokenizer(self, prompt_ids: list[int], skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, prompt_ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas that never split a UTF-8 character.

    Decodes a short window ``ids[prefix:]`` and emits what it adds beyond ``ids[prefix:read]``; a window that
    ends in U+FFFD (an incomplete byte sequence) is held back until the next token completes it. The window
    starts a few tokens into the prompt so tokenizers that strip a leading space (SentencePiece) decode the
    first generated word correctly. ``skip_special_tokens`` False writes special tokens out (vLLM's option).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], context: int = 5,
                 skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.ids = list(prompt_ids[-context:])
        self.prefix = 0
        self.read = len(self.ids)
        self.skip = skip_special_tokens

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix:self.read])
        new_text = self._decode(self.ids[self.prefix:])
        if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT_CHAR):
            self.prefix, self.read = self.read, len(self.ids)
            return new_text[len(prefix_text):]
        return ""

    def flush(self) -> str:
        """At the end of a sequence: whatever is still held back (possibly a lone replacement character)."""
        prefix_text = self._decode(self.ids[self.prefix:self.read])
        new_text = self._decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return new_text[len(prefix_text):]

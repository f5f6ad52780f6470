"""VocabBridge: text between two tokenizers, for a drafter whose vocabulary is not the target's (Timor et al. 2025).

Both sides are read as bytes: every token id's bytes (llguidance's index of the tokenizer, which knows byte-level,
metaspace and byte-fallback vocabularies alike), so a sequence of either side's ids is a byte string, and text moves
across by decoding one side's bytes and encoding them with the other side's tokenizer (the checkpoint's own,
through the HF tokenizer stack).

- ``shared``: the vocabularies' intersection, drafter id <-> target id of the same bytes (special tokens left out):
  what the token-level-intersection drafter may propose (``d2t``, ``t2d``; -1 where a token has no twin).
- ``DraftText``: a request's text in the drafter's tokens, kept up to date as the target emits tokens. Only the
  last word is re-encoded each time: BPE merges never cross a pre-token boundary, and a token that starts with
  whitespace after a non-space byte starts a pre-token in the byte-level vocabularies (GPT-2, Llama 3, SmolLM,
  Qwen), so the tokens before it are final. Which tokens the drafter reads only sways its guesses, never the output.
"""

from __future__ import annotations

import torch

_SPACE = frozenset(b" \t\n\r")


def token_bytes(tokenizer, vocab_size: int, eos: list[int]) -> tuple[list[bytes], list[bool]]:
    """(bytes of every id < vocab_size, whether it is a special token). Ids past the tokenizer (a padded embedding)
    get b"" and count as special: nothing ever maps to them."""
    from ..structured import _lltokenizer

    ll = _lltokenizer(tokenizer.hf, vocab_size, tuple(eos))
    n = min(vocab_size, len(tokenizer.hf))
    out = [ll.decode_bytes([i]) for i in range(n)] + [b""] * (vocab_size - n)
    special = [ll.is_special_token(i) for i in range(n)] + [True] * (vocab_size - n)
    return out, special


def utf8_split(raw: bytes) -> tuple[str, bytes]:
    """``raw`` -> (its text up to an unfinished character at the end, that character's bytes: at most 3). Bytes
    that can never form a character (a stray continuation byte) read as U+FFFD."""
    for i in range(1, min(4, len(raw)) + 1):
        c = raw[-i]
        if c & 0xC0 == 0x80:  # a continuation byte: its lead is further back
            continue
        need = 2 if c & 0xE0 == 0xC0 else 3 if c & 0xF0 == 0xE0 else 4 if c & 0xF8 == 0xF0 else 1
        if need > i:
            return raw[:-i].decode(errors="replace"), raw[-i:]
        break
    return raw.decode(errors="replace"), b""


class DraftText:
    """One request's text as the drafter reads it: ``ids`` = ``stable`` (final) + the encoding of ``tail``."""

    __slots__ = ("n_target", "pending", "stable", "tail", "ids")

    def __init__(self):
        self.n_target = 0  # target tokens read so far
        self.pending = b""  # bytes of an unfinished UTF-8 character (a byte token mid-character)
        self.stable: list[int] = []
        self.tail = ""  # the text after the last final token
        self.ids: list[int] = []


class VocabBridge:
    def __init__(self, target_tok, draft_tok, target_vocab: int, draft_vocab: int, target_eos: list[int],
                 draft_eos: list[int]):
        for side, tok in (("target", target_tok), ("drafter", draft_tok)):
            probe = "Hi there,\n  x = [1, 2]"
            if tok.hf.decode(tok.hf.encode(probe, add_special_tokens=False)) != probe:
                raise ValueError(f"the {side}'s tokenizer ({tok.path}) does not give text back as it was encoded "
                                 "(e.g. it adds a space before the first word): drafting across vocabularies needs "
                                 "tokenizers that round-trip text")
        self.t_enc, self.d_enc = target_tok.hf.backend_tokenizer, draft_tok.hf.backend_tokenizer
        self.t_bytes, t_special = token_bytes(target_tok, target_vocab, target_eos)
        self.d_bytes, d_special = token_bytes(draft_tok, draft_vocab, draft_eos)
        self.target_eos, self.draft_eos = list(target_eos), set(draft_eos)
        self.draft_special = d_special
        by_bytes = {b: i for i, b in enumerate(self.t_bytes) if b and not t_special[i]}
        self.d2t = torch.full((draft_vocab,), -1, dtype=torch.long)
        self.t2d = torch.full((target_vocab,), -1, dtype=torch.long)
        for d, b in enumerate(self.d_bytes):
            t = by_bytes.get(b)
            if t is not None and not d_special[d]:
                self.d2t[d], self.t2d[t] = t, d
        self.num_shared = int((self.d2t >= 0).sum())
        if self.num_shared == 0:
            raise ValueError("the drafter's and the target's vocabularies share no token")

    def encode_target(self, text: str) -> list[int]:
        return self.t_enc.encode(text, add_special_tokens=False).ids

    def encode_draft(self, text: str) -> list[int]:
        return self.d_enc.encode(text, add_special_tokens=False).ids

    def sync(self, state: DraftText, new_tokens: list[int]) -> list[int]:
        """Read the target's ``new_tokens`` (those after ``state.n_target``) into ``state``; returns ``state.ids``."""
        if not new_tokens:
            return state.ids
        state.n_target += len(new_tokens)
        text, state.pending = utf8_split(state.pending + b"".join(self.t_bytes[t] for t in new_tokens))
        if not text:
            return state.ids
        tail = state.tail + text
        raw = tail.encode()
        ids = self.encode_draft(tail)
        # the last pre-token start: a token beginning with whitespace right after a non-space byte
        off, cut, cut_off = 0, 0, 0
        for i, t in enumerate(ids):
            b = self.d_bytes[t]
            if i and b and b[0] in _SPACE and raw[off - 1] not in _SPACE:
                cut, cut_off = i, off
            off += len(b)
        if off != len(raw):  # a tokenizer that normalises text (its tokens' bytes do not spell it): no cut
            cut = cut_off = 0
        state.stable += ids[:cut]
        state.tail = raw[cut_off:].decode()
        state.ids = state.stable + ids[cut:]
        return state.ids

    def draft_to_target(self, draft_ids: list[int]) -> tuple[list[int], bool]:
        """The drafter's continuation -> (the target's tokens for its text, whether the drafter ended the text:
        an EOS, proposed as the target's first EOS, or another special token). Bytes of an unfinished character
        at the end are left out."""
        ended, eos = False, False
        for n, d in enumerate(draft_ids):
            if d in self.draft_eos or self.draft_special[d]:
                draft_ids, ended, eos = draft_ids[:n], True, d in self.draft_eos
                break
        text, _ = utf8_split(b"".join(self.d_bytes[d] for d in draft_ids))
        ids = self.encode_target(text) if text else []
        if eos and self.target_eos:
            ids.append(self.target_eos[0])
        return ids, ended

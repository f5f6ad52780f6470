"""Bad words (vLLM's ``bad_words``, Hugging Face's ``bad_words_ids``): token sequences a request never completes.

A bad word is a token sequence w_1 .. w_n. At a position whose output so far ends in w_1 .. w_{n-1} (any position,
for a one-token word), w_n gets a -inf logit, so the word can never be finished. Only the output is matched, not
the prompt (vLLM's rule). A word given as a string is tokenized twice, as vLLM does, so it is banned at the start of
the text and inside it: as written (leading spaces stripped) and after a space, the second kept only where the
space makes another first token of the same length.

Exactness under speculation: every path that samples or verifies against the target bans in place on the target's
logits before anything reads them (like ``sampling.ban_early_stops_``), each verified position matched against the
output plus the drafts before it (a tree node: the drafts on its path). The drafters do not see the ban: a draft that
completes a word has p = 0 there and is rejected, and the residual puts the mass back on allowed tokens.
"""

from __future__ import annotations

import torch


def bad_words_ids(words: list, tokenizer=None) -> list[list[int]]:
    """``SamplingParams.bad_words`` -> the token sequences to ban: a string by vLLM's rule (needs ``tokenizer``), a
    list of token ids as it is. ValueError naming the word that cannot be banned."""
    out: list[list[int]] = []
    for word in words:
        if not isinstance(word, str):
            out.append(list(word))
            continue
        if tokenizer is None:
            raise ValueError(f"SamplingParams.bad_words holds text ({word!r}) and this engine has no tokenizer: "
                             "give token ids")
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if not plain:
            raise ValueError(f"SamplingParams.bad_words holds {word!r}, which encodes to no token")
        out.append(plain)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return out


def banned_after(words: list[list[int]], context: list[int]) -> list[int]:
    """The last tokens of the ``words`` whose other tokens end ``context`` (the output so far): those banned next."""
    return [w[-1] for w in words if len(w) == 1 or
            (len(w) - 1 <= len(context) and context[len(context) - len(w) + 1:] == w[:-1])]


def ban_bad_words_(logits: torch.Tensor, reqs, drafted: list[list[list[int]]] | None = None) -> None:
    """Set the banned tokens' logits to -inf, in place: logits [B, V] (each request's next token) or [B, T, V] (a
    verify or a tree: position t of row b follows the output plus ``drafted[b][t]``, the drafts before it). A row's
    positions past ``len(drafted[b])`` are padding and left alone. A request's ``bad_words`` are token id lists
    (``Request.bad_words``). Where a request's ``allowed_token_ids`` would all be banned at a position, that
    position's ban is not applied (a law of nothing has no token to give; a one-token ban of them all is refused
    with the request)."""
    for b, r in enumerate(reqs):
        words = r.bad_words
        if not words:
            continue
        longest = max(map(len, words))
        tail = r.output_ids[-(longest - 1):] if longest > 1 else []
        allowed = r.params.allowed_token_ids
        for t, before in enumerate(drafted[b] if drafted is not None and logits.dim() == 3 else [[]]):
            ids = banned_after(words, tail + before)
            if not ids or allowed is not None and len(ids) >= len(allowed) and set(allowed) <= set(ids):
                continue
            if logits.dim() == 2:
                logits[b, ids] = float("-inf")
            else:
                logits[b, t, ids] = float("-inf")


def chain_drafted(drafts: list[list[int]]) -> list[list[list[int]]]:
    """A chain verify's ``drafted`` (``ban_bad_words_``): position t of row b follows the row's first t drafts."""
    return [[d[:t] for t in range(len(d) + 1)] for d in drafts]


def tree_drafted(trees) -> list[list[list[int]]]:
    """A tree verify's ``drafted``: node i follows the drafts on its path, itself included and the root (the row's
    last token, node 0) not."""
    out = []
    for t in trees:
        paths = []
        for i in range(len(t.tokens)):
            path, u = [], i
            while u > 0:  # up to the root: a tree is a few nodes deep
                path.append(t.tokens[u])
                u = t.parents[u]
            paths.append(path[::-1])
        out.append(paths)
    return out

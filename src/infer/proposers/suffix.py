"""Suffix decoding (Oliaro et al., "SuffixDecoding", 2024-25; vLLM's ``suffix`` method, Snowflake's arctic-inference
are the peers): drafts from a suffix tree over the prompts and outputs of this engine's earlier requests and of the
running ones, the request's own context included. No model: a lookup costs microseconds.

    SuffixProposer(max_depth=24, max_tokens=1_000_000, min_prob=0.3, length_factor=1.0, min_match=1,
                   own_length_factor=2.0)

The tree (suffix_tree.cpp, built on first use like infer's kernels) holds every substring of up to ``max_depth``
tokens of every sequence, with counts, and each node's most frequent child. A round tries every suffix of a
request's context (up to ``max_depth - 1`` tokens; the request's own sequence in the tree holds their nodes, so a
lookup walks no path: ~2 us); from each it follows the most frequent continuation while its estimated probability
(the product of the children's shares of their parents' counts) stays >= ``min_prob``, up to K and no more than
``length_factor`` x the match's length: a long, frequent match drafts many tokens, a rare one few or none (the draft
length is the match's frequency). Of these drafts the round keeps the one with the most expected accepted tokens (the
sum of its prefixes' probabilities; SuffixDecoding's and arctic-inference's rule), the longer match at a tie. A
match shorter than ``min_match`` tokens drafts nothing. Auto K prices the drafts by these probabilities as it has
learnt them to hold (spec_decode.spec_length, "Confident free drafts"), apart for matches of 1, 2, 3 and 4+ tokens:
in a replay of plain decoding's outputs this chose K better than one calibration for all (the JSON loop 1.950x ->
1.972x over plain, code edit 1.556x -> 1.570x, the chat control 1.183x -> 1.200x; held-out code 1.501x -> 1.562x
in a replay apart), and the engines read 1.000-1.033x a pass (benchmarks/suffix_calibration.py, docs/benchmarks.md).

Each running request also has a tree of its own text alone (its prompt and output; arctic-inference keeps one per
prompt too), looked up the same way with up to ``own_length_factor`` x the match's length (None: no own tree); its
draft wins where it expects more accepted tokens than the shared tree's (the shared one at a tie). Why: a value the
request's record holds once (a name, a number to copy into the JSON) is certain in its own tree and one guess among
every earlier record's in the shared one, under min_prob there. Its drafts are calibrated in groups of their own
(4-7 by match length). Replayed over plain decoding's outputs (suffix.replay, auto K's rule with groups): the JSON
loop 1.972x -> 2.090x over plain, code edit 1.570x -> 1.599x; held out, chat 1.200x -> 1.194x and code 1.576x ->
1.577x (own_length_factor 1.0: 2.029x / 1.566x / 1.204x / 1.601x; 3.0: 2.081x / 1.616x / 1.195x / 1.573x).

A request may bring a predicted output (OpenAI's ``prediction``: ``Request.prediction``, text its answer is expected
to repeat, a file being edited). It enters the request's own tree as a second text, after the prompt's last
``max_depth - 1`` tokens, so the context matches it from the first output token on, and again after an edit (the
longest suffix of the context found anywhere in it). Only the request's own tree holds it: another user's prediction
never drafts for this one. On SmolLM2 an exact prediction of a 242-token answer read 956 against 460 decode tok/s
(docs/benchmarks.md).

With ``spec_tree`` (docs/design.md, token trees) it drafts trees: from the match the chain starts at, in each tree
the ``width`` most frequent children of a node, grown best first while the path's probability stays >= ``min_prob``,
the two trees merged and scored by those probabilities (SuffixDecoding's speculation trees). Replayed over plain
decoding's outputs where extra verify rows are nearly free (v(n) = 1 + 0.02 n, a GPU's verify; depth 8, width 3, 15
nodes against the chain of up to 8): accepted drafts +2.3% on the JSON loop (3.60x -> 3.73x predicted), +1.8% code
edit, +5.6% chat. At the chain's width (what ``spec_tree="auto"`` gives a lone request on this CPU, where a verify
row costs ~0.2 of a step) the tree of the k best nodes accepts 0.6% fewer on the JSON loop and as many elsewhere
(benchmarks/suffix_trees.py): chains stay the default.

The defaults (a one-token match drafts, at most as many tokens as the match is long, while the continuation's
probability stays >= 0.3) come from replaying plain decoding's outputs through the tree and pricing each round with
the measured verify costs (benchmarks/suffix.py's ceiling, docs/benchmarks.md): against the first defaults (0.1,
2.0, a match of 2), the predicted decode speed-up rose from 1.62 to 1.68x on the code-edit loop, 1.69 to 1.88x on
JSON extraction and 1.09 to 1.16x on chat, and on prompts not used to choose them (held-out code and chat) from
1.36 to 1.43x and 1.27 to 1.32x. A one-token match lets a value's tail follow its first token (an order's city,
a key after its punctuation); the tighter probability and length bounds keep the extra drafts from costing rows.

A request's tokens enter the tree as it grows (prompt first, then each round's accepted tokens) and stay after it
finishes; finished requests are evicted oldest first once the tree holds more than ``max_tokens`` tokens. Drafts are
deterministic (q = one-hot) and verified exactly like prompt lookup's, so what the tree holds, another user's text
included, can change only how fast a request runs, never what it outputs (tests/test_suffix.py shows a request's
output equal with the tree empty and full). Requests of one engine share its proposer; the engine steps from one
thread, so the tree needs no lock.

Auto K asks every row every round (``offers``): the rows not yet looked up at their length are fed and looked up in
both their trees by one C++ call for the batch (``lookup_rows``; row by row from Python it cost ~50 us a row, 3.5% of
an 8-row step on the chat control; now ~10 us).
"""

from __future__ import annotations

import itertools
import weakref
from collections import OrderedDict
from pathlib import Path

from ..request import Request
from ..spec_decode.tree import DraftTree
from .base import DraftBatch, Proposal, Proposer
from .ngram import _proposal

_module = None
MATCH_GROUPS = 4  # auto K calibrates the confidences of matches of 1, 2, 3 and 4+ tokens apart (confidence_group)
# (in each tree: groups 0-3 the shared tree's, 4-7 the request's own)


SOURCE = Path(__file__).with_name("suffix_tree.cpp")


def build_dir() -> Path:
    """Where the suffix tree's build is cached: beside infer's kernels, named by its source's hash and the
    environment's headers (kernels.toolchain_key: two virtualenvs sharing the cache would rebuild it at each switch;
    the name is the module's, so the key goes into the hash)."""
    import hashlib

    from ..cachedir import cache_dir
    from ..kernels import toolchain_key

    key = hashlib.sha256(SOURCE.read_bytes() + toolchain_key(SOURCE.parent).encode()).hexdigest()[:12]
    return cache_dir("kernels") / ("infer_suffix_" + key)


def suffix_tree_module():
    """The compiled SuffixTree (a small pybind11 module, cached on disk like infer's kernels)."""
    global _module
    if _module is None:
        from torch.utils.cpp_extension import load

        from ..cachedir import build_lock
        from ..kernels import _ensure_ninja_on_path

        build = build_dir()
        _ensure_ninja_on_path()
        try:
            with build_lock(build):
                _module = load(name=build.name, sources=[str(SOURCE)], extra_cflags=["-O2"],
                               build_directory=str(build), verbose=False)
        except Exception as e:  # noqa: BLE001  (no compiler: the proposer cannot run; say so in one line)
            lines = str(e).strip().splitlines()
            raise RuntimeError("proposer='suffix' needs its C++ suffix tree, which could not be built "
                               f"({type(e).__name__}: {lines[-1] if lines else ''})") from None
    return _module


def check_options(max_depth, max_tokens, min_prob, length_factor, min_match, own_length_factor,
                  name: str = "suffix {}") -> None:
    """Raise ValueError naming the first bad option, as ``name`` spells it (SuffixProposer's arguments; EngineConfig's
    suffix_* fields)."""
    def whole(v):
        return isinstance(v, int) and not isinstance(v, bool)

    def real(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    if not whole(max_depth) or max_depth < 2:
        raise ValueError(f"{name.format('max_depth')} must be an integer >= 2, got {max_depth!r}")
    if not whole(max_tokens) or max_tokens < 1:
        raise ValueError(f"{name.format('max_tokens')} must be an integer >= 1, got {max_tokens!r}")
    if not real(min_prob) or not 0.0 < min_prob <= 1.0:
        raise ValueError(f"{name.format('min_prob')} must be in (0, 1], got {min_prob!r}")
    if not real(length_factor) or not length_factor > 0.0:  # the C++ side reads <= 0 as "no cap"
        raise ValueError(f"{name.format('length_factor')} must be > 0, got {length_factor!r}")
    if not whole(min_match) or min_match < 1:
        raise ValueError(f"{name.format('min_match')} must be an integer >= 1, got {min_match!r}")
    if own_length_factor is not None and (not real(own_length_factor) or not own_length_factor > 0.0):
        raise ValueError(f"{name.format('own_length_factor')} must be > 0 (or None: no own tree), "
                         f"got {own_length_factor!r}")


class _Row:
    """A running request's state in the proposer: its sequence id in the shared tree, its own tree (None: none, or
    finished), the tokens both have seen (they are fed together), and its latest lookup (``_lookup``'s memo:
    (tokens, k, drafts, confidences, group))."""

    __slots__ = ("seq", "own", "fed", "memo")

    def __init__(self, seq: int, own):
        self.seq, self.own, self.fed, self.memo = seq, own, 0, None

    def unfed(self, req: Request) -> list[int]:
        """The tokens ``req`` gained since its trees last saw it (its prompt, the first time), counted as fed now."""
        fed, n = self.fed, req.num_tokens
        if fed >= n:
            return []
        self.fed = n
        return req.token_slice(fed)


class SuffixProposer(Proposer):
    name = "suffix"

    def __init__(self, max_depth: int = 24, max_tokens: int = 1_000_000, min_prob: float = 0.3,
                 length_factor: float = 1.0, min_match: int = 1, own_length_factor: float | None = 2.0):
        check_options(max_depth, max_tokens, min_prob, length_factor, min_match, own_length_factor)
        self.max_depth, self.max_tokens, self.min_prob, self.length_factor = max_depth, max_tokens, min_prob, \
            length_factor
        self.min_match, self.own_length_factor = min_match, own_length_factor
        self.tree = suffix_tree_module().SuffixTree(max_depth)
        self._rows: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Request -> _Row, while it runs
        self._done: OrderedDict[int, None] = OrderedDict()  # finished sequences, oldest first: what eviction takes
        self._ids = itertools.count()

    # -- the tree ---------------------------------------------------------------------------------------------
    def _row(self, req: Request) -> _Row:
        """``req``'s state here: a sequence id in the tree (and its own tree) the first time."""
        row = self._rows.get(req)
        if row is None:
            own = suffix_tree_module().SuffixTree(self.max_depth) if self.own_length_factor is not None else None
            if own is not None and req.prediction:
                # a predicted output (OpenAI's): a second text of the request's own tree, after the prompt's tail, so
                # the context matches it from the first output token on and again after an edit
                own.extend(1, req.prompt_ids[-(self.max_depth - 1):] + req.prediction)
            row = self._rows[req] = _Row(next(self._ids), own)
            weakref.finalize(req, self._retire, row.seq)  # a request dropped unfinished still counts as text seen
        return row

    def _sync(self, req: Request) -> _Row:
        """Add the tokens ``req`` gained since its last round (its prompt, the first time) to both its trees."""
        row = self._row(req)
        new = row.unfed(req)
        if new:
            self.tree.extend(row.seq, new)
            if row.own is not None:
                row.own.extend(0, new)
        return row

    def finished(self, req: Request) -> None:
        """``req`` will not grow again: its text stays in the tree, evictable oldest first."""
        if req in self._rows:
            self._retire(self._sync(req).seq)
            self._rows[req].own = None  # its own tree is for drafting while it runs

    def _retire(self, seq: int) -> None:
        if seq in self._done or not self.tree.has(seq):
            return
        self._done[seq] = None
        while self.tree.num_tokens() > self.max_tokens and self._done:
            self.tree.remove(self._done.popitem(last=False)[0])

    def clear(self) -> None:
        """Forget every request's text (a fresh tree); running requests re-enter it at their next round."""
        self.tree = suffix_tree_module().SuffixTree(self.max_depth)
        self._rows = weakref.WeakKeyDictionary()
        self._done.clear()

    def lookup(self, req: Request, k: int) -> list[int]:
        """Up to ``k`` drafts continuing ``req``'s context, [] where the tree has no confident continuation."""
        return self._lookup(req, k)[0]

    def _lookup(self, req: Request, k: int) -> tuple[list[int], list[float]]:
        """(drafts, each draft's probability under the counts given the drafts before it). A round asks three times
        (auto K's count and confidence at the row's cap, then the proposal at the K chosen): the answer is kept per
        request and length, and a smaller k takes its first k, so the drafts proposed are the drafts priced, even
        where other rows' text entered the tree in between."""
        return self._lookup_grouped(req, k)[:2]

    def _lookup_grouped(self, req: Request, k: int) -> tuple[list[int], list[float], int]:
        """``_lookup``'s (drafts, confidences) and their confidence group: the length of the context's match they
        continue, 1, 2, 3 or 4+ tokens -> 0-3 in the shared tree, 4-7 in the request's own."""
        return self._lookup_rows([req], [k])[0]

    def _lookup_rows(self, reqs: list[Request], ks: list[int]) -> list[tuple[list[int], list[float], int]]:
        """``_lookup_grouped`` for every row at once: the rows not memoised are fed and looked up in one C++ call
        (suffix_tree.cpp's lookup_rows; per row it was ~50 us of Python at 8 rows)."""
        out: list = [None] * len(reqs)
        todo, rows = [], []
        for b, (req, k) in enumerate(zip(reqs, ks)):
            if k <= 0:
                out[b] = ([], [], 0)
                continue
            row = self._rows.get(req) or self._row(req)
            memo = row.memo
            if memo is not None and memo[0] == req.num_tokens and k <= memo[1]:
                out[b] = (memo[2][:k], memo[3][:k], memo[4])
            else:
                todo.append(b)
                rows.append(row)
        if not todo:
            return out
        feeds = [row.unfed(reqs[b]) for b, row in zip(todo, rows)]  # both trees have seen as much (_Row)
        found = suffix_tree_module().lookup_rows(self.tree, [row.seq for row in rows], feeds, [row.own for row in rows],
                                                 feeds, [ks[b] for b in todo], self.min_prob, self.min_match,
                                                 self.length_factor, self.own_length_factor or 0.0, MATCH_GROUPS)
        for b, row, (drafts, cond, group) in zip(todo, rows, found):
            row.memo = (row.fed, ks[b], drafts, cond, group)
            out[b] = (drafts[:], cond[:], group)
        return out

    # -- the proposer seam ------------------------------------------------------------------------------------
    def free_drafts(self, req: Request, k: int) -> int:
        return len(self._lookup(req, k)[0])  # every draft is a copy from the tree; none: the row decodes plainly

    def offers(self, reqs: list[Request], ks: list[int]):
        return [(len(d), c, g) if k > 0 else None for (d, c, g), k in zip(self._lookup_rows(reqs, ks), ks)]

    def draft_confidence(self, req: Request, k: int) -> list[float]:
        return self._lookup(req, k)[1]

    def confidence_group(self, req: Request, k: int) -> int:
        """The matched context's length, 1, 2, 3 or 4+ tokens (groups 0-3; 4-7 where the request's own tree drafted):
        after a one-token match a continuation's share of the counts is a weaker guess than the same share after a
        longer one, and a share among one request's few occurrences another guess again (module docstring)."""
        return self._lookup_grouped(req, k)[2]

    def propose(self, batch: DraftBatch) -> Proposal:
        return _proposal([self.lookup(r, k) for r, k in zip(batch.reqs, batch.ks)], batch)

    supports_tree = True

    def propose_tree(self, batch: DraftBatch, width: int) -> list[DraftTree]:
        """A tree per row, up to ``batch.ks[b]`` deep: from the match the chain starts at, in each tree (the shared
        one, the request's own), the ``width`` most frequent children of a node grown best first while the path's
        probability stays >= ``min_prob``, merged; scored by that probability (the round prunes to its budget)."""
        trees = []
        for r, k in zip(batch.reqs, batch.ks):
            tree = DraftTree(r.last_token)
            if k > 0:
                row = self._sync(r)
                sources = [(self.tree, row.seq, self.length_factor)]
                if row.own is not None:
                    sources.append((row.own, 0, self.own_length_factor))
                for t, seq, factor in sources:
                    toks, parents, probs = t.speculate_tree_stored(seq, k, width, k * width, self.min_prob,
                                                                   self.min_match, length_factor=factor)
                    at: list[int] = []  # this output's node i -> its node in `tree`
                    for tok, par, p in zip(toks, parents, probs):
                        at.append(tree.add(0 if par < 0 else at[par], tok, p))
            trees.append(tree)
        return trees

"""Structured output: a constraint (JSON schema, any JSON object, regex, choice, grammar) as a per-request matcher
that says, at every position, which tokens may come next.

    spec = StructuredOutput(json_schema={"type": "object", ...})     # in SamplingParams(structured=spec)
    compiler = GrammarCompiler(tokenizer, vocab_size, eos_ids)      # one per engine (llguidance's tokenizer index)
    matcher = compiler.matcher(spec)                                 # one per request; ValueError names a bad spec
    matcher.fill(bitmask, row); mask_logits_(logits, bitmask)        # disallowed tokens -> -inf

The grammars are compiled and matched by llguidance (Microsoft's engine behind Guidance, also a vLLM and llama.cpp
backend): no JSON-schema or regex engine of our own. Masks are llguidance's bitmasks: int32 words, token t allowed iff
bit t % 32 of word t // 32 is set.

Exactness: the sampler sets every disallowed logit to -inf before the sampling pipeline (sampling.logits_to_probs),
so the law sampled is the target's restricted to the allowed tokens and renormalised; speculative rounds mask the
target at each of their K+1 positions and the drafter's q the same way (spec_decode.grammar), so rejection sampling
reproduces that law exactly.

Invariant: outside a speculative round a request's Matcher has consumed exactly its ``output_ids`` (Request.append
advances it); a round advances it over drafts and rolls it back before emitting. llguidance's matcher enters a
permanent error state on a token it does not allow, so nothing is consumed without checking its mask bit first.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from functools import lru_cache

import torch

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
_BITS = torch.arange(32, dtype=torch.int32)


@dataclass(frozen=True)
class StructuredOutput:
    """Exactly one constraint. JSON (schema or any object) is generated compact, without free whitespace between
    tokens (``{"a":1}``): a small model given the freedom can loop on blanks forever. ``grammar`` is Lark (llguidance's
    dialect: ``start: ...``), or GBNF / EBNF as llama.cpp writes it (rules with ``::=``, starting at ``root``)."""

    json_schema: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None

    def __post_init__(self):
        given = [k for k in KINDS if (getattr(self, k) not in (None, False))]
        if len(given) != 1:
            raise ValueError(f"structured output takes exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(given) if given else 'none'}")
        if isinstance(self.json_schema, str):
            try:
                schema = json.loads(self.json_schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"json_schema is not valid JSON: {e}") from None
            object.__setattr__(self, "json_schema", schema)
        if self.json_schema is not None and not isinstance(self.json_schema, (dict, bool)):
            raise ValueError(f"json_schema must be a JSON object (a dict), got {type(self.json_schema).__name__}")
        if self.json_object not in (True, False):
            raise ValueError("json_object must be a bool")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"{name} must be a non-empty string")
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) and c for c in self.choice) \
                    or not self.choice:
                raise ValueError("choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))

    @property
    def key(self) -> str:
        """A hashable identity (the compiled grammars' cache key)."""
        value = getattr(self, self.kind)
        return f"{self.kind}:{json.dumps(value, sort_keys=True) if self.kind == 'json_schema' else value!r}"

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def grammar_text(self) -> str:
        """The constraint as an llguidance grammar (not yet checked: GrammarCompiler.compile says what is wrong)."""
        from llguidance import LLMatcher, grammar_from

        compact = {"whitespace_flexible": False}
        if self.json_schema is not None:
            return LLMatcher.grammar_from_json_schema(json.dumps(self.json_schema), defaults=compact)
        if self.json_object:
            return LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=compact)
        if self.regex is not None:
            return LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            return grammar_from("choice", json.dumps(list(self.choice)))
        return grammar_from("gbnf" if "::=" in self.grammar else "lark", self.grammar)


@lru_cache(maxsize=8)
def _lltokenizer(hf, n_vocab: int, eos: tuple[int, ...]):
    """llguidance's index of a tokenizer (~1 s for a 49k vocabulary): built once per tokenizer, shared by matchers."""
    import llguidance.hf

    return llguidance.hf.from_tokenizer(hf, n_vocab=n_vocab, eos_token=list(eos))


class GrammarCompiler:
    """Compiles StructuredOutput specs into matchers for one tokenizer and logits width (an engine's)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]):
        """``tokenizer``: infer.tokenizer.Tokenizer (its HF fast tokenizer); ``vocab_size``: the model's logits width
        (may exceed the tokenizer's: padded ids are never allowed); ``eos_token_ids``: what ends a grammar."""
        if tokenizer is None:
            raise ValueError("structured output needs the model's tokenizer (an engine built without one)")
        if not eos_token_ids:
            raise ValueError("structured output needs an end-of-sequence token id to end a finished grammar")
        self.vocab_size = vocab_size
        self.lltok = _lltokenizer(tokenizer.hf, max(vocab_size, len(tokenizer.hf)), tuple(eos_token_ids))
        self.words = (self.lltok.vocab_size + 31) // 32  # int32 words a mask row takes
        self._checked: dict[str, str] = {}  # StructuredOutput.key -> grammar text, checked

    def compile(self, spec: StructuredOutput) -> str:
        """The grammar text of ``spec``, checked: ValueError naming the constraint and llguidance's message."""
        from llguidance import LLMatcher

        if spec.key in self._checked:
            return self._checked[spec.key]
        try:
            text = spec.grammar_text()
            err = LLMatcher.validate_grammar(text, self.lltok)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # noqa: BLE001  (a Rust panic surfaces as pyo3's PanicException, a BaseException)
            raise ValueError(f"invalid {spec.kind}: {e}") from None
        if err and not err.startswith("WARNING"):
            raise ValueError(f"invalid {spec.kind}: {err}")
        if len(self._checked) < 256:  # a server sees the same few schemas again and again
            self._checked[spec.key] = text
        return text

    def matcher(self, spec: StructuredOutput) -> Matcher:
        return Matcher(self, self.compile(spec))

    def bitmask(self, rows: int) -> torch.Tensor:
        """[rows, words] int32, every token allowed (-1: all bits set)."""
        return torch.full((rows, self.words), -1, dtype=torch.int32)


class Matcher:
    """One request's grammar state (llguidance's LLMatcher), advanced token by token and rolled back."""

    def __init__(self, compiler: GrammarCompiler, grammar: str):
        from llguidance import LLMatcher

        self.compiler = compiler
        self.m = LLMatcher(compiler.lltok, grammar, log_level=0)
        if self.m.is_error():
            raise ValueError(f"invalid grammar: {self.m.get_error()}")
        # llguidance does not count an EOS consumed once the grammar has stopped (is_stopped: nothing but EOS can
        # follow), so a rollback must skip it: one flag per consumed token, True where llguidance counted it
        self._counted: list[bool] = []

    @property
    def consumed(self) -> int:
        return len(self._counted)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` ([rows, words] int32, CPU, contiguous)."""
        import llguidance.torch

        llguidance.torch.fill_next_token_bitmask(self.m, bitmask, row)

    def accept(self, token: int) -> bool:
        """Advance over ``token``; False (state unchanged) when the grammar does not allow it here."""
        stopped = self.m.is_stopped()
        if stopped:  # only EOS may follow, and llguidance does not count it
            if token not in self.compiler.lltok.eos_tokens:
                return False
            self._counted.append(False)
            return True
        if self.m.validate_tokens([token]) != 1:
            return False
        self.m.consume_token(token)
        self._counted.append(True)
        return True

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` accepted tokens."""
        if n <= 0:
            return
        undo, self._counted = sum(self._counted[-n:]), self._counted[:-n]
        if undo:
            self.m.rollback(undo)

    def forced(self) -> list[int]:
        """The tokens the grammar forces next (its fixed text, e.g. a JSON key and ``":``, canonically tokenized;
        the end-of-sequence token once the grammar has stopped), [] where it leaves a choice."""
        if self.m.is_stopped():
            return [self.compiler.lltok.eos_token]
        return self.m.compute_ff_tokens()

    @property
    def done(self) -> bool:
        """The grammar is complete and nothing but an end-of-sequence token may follow."""
        return self.m.is_stopped()


# bias of a mask byte: _BYTE_BIAS[b, k] = 0 where bit k of b is set (allowed), else -inf. A mask word's bytes are its
# bits 0-7, 8-15, ... on a little-endian machine, so a row's bytes in order are its tokens in order.
_BYTE_BIAS = torch.where(((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool(), 0.0, float("-inf"))
assert sys.byteorder == "little", "structured output's masks are read as little-endian words"


def mask_bias(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[..., words] int32 bitmask -> [..., vocab_size] float32: 0 where a token is allowed, -inf where not (columns
    past the mask's are not allowed). Adding it to logits is the mask: one gather of 8 values a byte and one add,
    branch-free (a masked_fill over a scattered 49,152-token mask costs ~6x as much)."""
    lead = bitmask.shape[:-1]
    by = bitmask.contiguous().view(torch.uint8).reshape(-1).long()
    bias = _BYTE_BIAS.index_select(0, by).view(*lead, -1)
    if bias.shape[-1] >= vocab_size:
        return bias[..., :vocab_size]
    pad = torch.full((*lead, vocab_size - bias.shape[-1]), float("-inf"))
    return torch.cat([bias, pad], -1)


def allowed(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[..., words] int32 bitmask -> [..., vocab_size] bool (columns past the mask's are not allowed)."""
    bits = (bitmask[..., None] >> _BITS.to(bitmask.device)) & 1  # [..., words, 32]
    out = bits.flatten(-2).bool()
    if out.shape[-1] >= vocab_size:
        return out[..., :vocab_size]
    pad = torch.zeros(*out.shape[:-1], vocab_size - out.shape[-1], dtype=torch.bool, device=out.device)
    return torch.cat([out, pad], -1)


def bit(bitmask_row: torch.Tensor, token: int) -> bool:
    """Whether ``token`` is allowed by one mask row ([words] int32)."""
    return bool((int(bitmask_row[token >> 5]) >> (token & 31)) & 1)


def mask_logits_(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [..., V] (in place) -> disallowed tokens at -inf; ``bitmask`` [..., words] on the CPU."""
    return logits.add_(mask_bias(bitmask, logits.shape[-1]).to(logits.device))


def mask_rows_(logits: torch.Tensor, matchers: list) -> torch.Tensor:
    """logits [N, V] of N requests' next tokens, in place: each row with a Matcher restricted to what it allows
    (rows whose matcher is None untouched). The plain decode and prefill steps' masking."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return logits
    bm = matchers[rows[0]].compiler.bitmask(len(rows))
    for j, i in enumerate(rows):
        matchers[i].fill(bm, j)
    idx = torch.tensor(rows, device=logits.device)
    logits[idx] = mask_logits_(logits[idx], bm)
    return logits

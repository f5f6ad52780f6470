"""Drafters with another tokenizer (proposers.cross_tokenizer, proposers.vocab_bridge): the text between the two
vocabularies, and losslessness of both algorithms (string-level, token-level intersection): greedy parity with
plain decoding (both KV backends, batched, with preemption) and the exact joint law of a round's two tokens at
temperature 1 (chi-square), with a lossy rule caught.

The pair: a target over a 320-token byte-level BPE and a drafter over another one: every id shifted by three extra
special tokens, the same merges ("shifted"), or 20 merges fewer too ("smaller"). The drafter is the target
translated into its vocabulary (a shared token's rows are its twin's, plus noise): where both spell the text alike
it agrees with the target, so drafts are often accepted and rejections are frequent too.
"""

import dataclasses

import pytest
import torch
from scipy.stats import chisquare

from infer.engine import Engine, EngineConfig
from infer.generate import autoregressive_generate
from infer.model.llama import LlamaForCausalLM
from infer.proposers.vocab_bridge import DraftText, VocabBridge, utf8_split
from infer.sampling import SamplingBatch, SamplingParams, logits_to_probs
from infer.speculative import speculative_generate
from infer.testing import build_tokenizer, random_llama
from infer.tokenizer import Tokenizer

TEXT = "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n"


EXTRA = ("<|pad|>", "<|sep|>", "<|mask|>")


@pytest.fixture(scope="module")
def tokenizer_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("xtok")
    build_tokenizer(320).save_pretrained(root / "target")
    build_tokenizer(323, extra_specials=EXTRA).save_pretrained(root / "shifted")
    build_tokenizer(300, extra_specials=EXTRA).save_pretrained(root / "smaller")
    return root


@pytest.fixture(scope="module")
def tokenizers(tokenizer_dirs):
    return Tokenizer(tokenizer_dirs / "target"), Tokenizer(tokenizer_dirs / "shifted")


@pytest.fixture(scope="module")
def smaller(tokenizer_dirs):
    return Tokenizer(tokenizer_dirs / "target"), Tokenizer(tokenizer_dirs / "smaller")


def _bridge(tokenizers):
    tt, dt = tokenizers
    return VocabBridge(tt, dt, len(tt.hf), len(dt.hf), tt.eos_token_ids, dt.eos_token_ids)


def translated(target: LlamaForCausalLM, bridge: VocabBridge, noise: float, seed: int = 5) -> LlamaForCausalLM:
    """The target in the drafter's vocabulary: a shared token's embedding and head rows are its twin's; the rest
    random; every weight perturbed by ``noise`` (relative)."""
    Vd = len(bridge.d2t)
    cfg = dataclasses.replace(target.config, vocab_size=Vd)
    drafter = LlamaForCausalLM(cfg)
    state = target.state_dict()
    g = torch.Generator().manual_seed(seed)
    shared = bridge.d2t >= 0
    for name in ("embed_tokens.weight", "lm_head.weight"):
        w = torch.randn(Vd, cfg.hidden_size, generator=g) * state[name].std()
        w[shared] = state[name][bridge.d2t[shared]]
        state[name] = w
    drafter.load_state_dict(state)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(noise * p.abs().mean() * torch.randn(p.shape, generator=g))
    return drafter.eval().requires_grad_(False)


class TextOnly(LlamaForCausalLM):
    """A model that never emits a token that is not whole UTF-8 text (``text_mask``: -inf there). A random model
    would emit stray bytes, text no tokenizer reads back, which real models do not."""

    def compute_logits(self, hidden, lens=None):
        return super().compute_logits(hidden, lens) + self.text_mask


def text_only(model: LlamaForCausalLM, token_bytes: list[bytes]) -> LlamaForCausalLM:
    def whole(b: bytes) -> bool:
        try:
            return bool(b.decode())
        except UnicodeDecodeError:
            return False

    model.__class__ = TextOnly
    model.text_mask = torch.tensor([0.0 if whole(b) else float("-inf") for b in token_bytes])
    return model


@pytest.fixture(scope="module")
def pair(tokenizers):
    tt, _ = tokenizers
    bridge = _bridge(tokenizers)
    target = text_only(random_llama(len(tt.hf), seed=0, logit_scale=6.0), bridge.t_bytes)
    return target, text_only(translated(target, bridge, noise=0.03), bridge.d_bytes)


# -- the bridge ------------------------------------------------------------------------------------------------
def test_shared_tokens_have_the_same_bytes(smaller):
    b = _bridge(smaller)
    tt, dt = smaller
    assert 250 < b.num_shared <= 300
    for d in range(len(dt.hf)):
        t = int(b.d2t[d])
        if t >= 0:
            assert b.t_bytes[t] == b.d_bytes[d] and int(b.t2d[t]) == d
    assert int(b.d2t[dt.hf.convert_tokens_to_ids("ĊĠĠĠ")]) == tt.hf.convert_tokens_to_ids("ĊĠĠĠ")
    assert dt.hf.convert_tokens_to_ids("ĊĠĠĠ") != tt.hf.convert_tokens_to_ids("ĊĠĠĠ")  # the ids do differ
    assert (b.d2t[[dt.hf.convert_tokens_to_ids(s) for s in ("<|pad|>", "<|end_of_text|>")]] == -1).all()


def test_utf8_split_holds_back_an_unfinished_character_only():
    assert utf8_split("é".encode()[:1]) == ("", b"\xc3")
    assert utf8_split(b"ab\xe4\xbd") == ("ab", b"\xe4\xbd")
    assert utf8_split(b"a\x87b") == ("a\ufffdb", b"")  # a stray continuation byte never completes
    assert utf8_split("\U0001f600".encode()) == ("\U0001f600", b"")


@pytest.mark.parametrize("text", [TEXT, "The quick brown fox.  Hello   world!\n\n\tCaf\u00e9 \U0001f600 na\u00efve x"])
def test_incremental_text_matches_encoding_it_whole(smaller, text):
    """Read token by token (the target's tokens, a byte token may split a character), the drafter's tokens are its
    encoding of the whole text: only the last word is re-encoded, and that is enough."""
    tt, dt = smaller
    b = _bridge(smaller)
    st = DraftText()
    ids = tt.encode(text, add_special_tokens=False)
    for i, t in enumerate(ids):
        b.sync(st, [t])
        assert st.n_target == i + 1
    assert st.ids == dt.encode(text, add_special_tokens=False)
    assert st.pending == b"" and len(st.stable) > len(st.ids) // 2


def test_draft_to_target_re_tokenises_and_maps_eos(smaller):
    tt, dt = smaller
    b = _bridge(smaller)
    d = dt.encode("    return a", add_special_tokens=False)
    assert b.draft_to_target(d) == (tt.encode("    return a", add_special_tokens=False), False)
    ids, ended = b.draft_to_target(d + dt.eos_token_ids[:1] + d)
    assert ended and ids == tt.encode("    return a", add_special_tokens=False) + tt.eos_token_ids[:1]


def test_a_tokenizer_that_does_not_round_trip_is_named(tokenizers, tmp_path):
    from tokenizers import decoders, normalizers

    tt, dt = tokenizers
    hf = build_tokenizer(300)
    hf.backend_tokenizer.normalizer = normalizers.Lowercase()
    hf.backend_tokenizer.decoder = decoders.ByteLevel()
    hf.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="round-trip"):
        VocabBridge(tt, Tokenizer(tmp_path), 320, 300, tt.eos_token_ids, [1])


# -- losslessness through the engine ---------------------------------------------------------------------------
def _engine(pair, tokenizers, method, **cfg):
    target, drafter = pair
    tt, dt = tokenizers
    return Engine(EngineConfig(model="target", draft_model="drafter", cross_tokenizer=method, spec_length=3,
                               block_size=4, **cfg), model=target, draft_model=drafter, tokenizer=tt,
                  draft_tokenizer=dt)


@pytest.mark.parametrize("method,backend", [("string", "paged"), ("intersection", "contiguous"),
                                            ("string", "contiguous"), ("intersection", "paged")])
def test_batched_greedy_parity_with_preemption(pair, tokenizers, method, backend):
    target, _ = pair
    tt, _ = tokenizers
    kw = dict(num_kv_blocks=24) if backend == "paged" else dict(max_seq_len=80)
    eng = _engine(pair, tokenizers, method, max_batch_size=5, kv_cache_backend=backend, **kw)
    lines = TEXT.splitlines()
    prompts = [tt.encode("\n".join(lines[i:i + 2]), add_special_tokens=False) for i in range(len(lines) - 1)] * 2
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    reqs = eng.run([eng.add_request(p, params, eos_token_ids=[]) for p in prompts])
    assert [r.output_ids for r in reqs] == [autoregressive_generate(target, p, params, eos_token_ids=[]).output_ids
                                            for p in prompts]
    assert eng.stats.num_accepted_tokens > 0 and eng.stats.num_draft_tokens > 100
    if backend == "paged":
        assert eng.stats.num_preemptions > 0
    assert eng.free_kv_tokens() == eng.initial_free_kv_tokens
    assert not eng.decoder.proposer._slot  # every request's drafter slot is back


def test_library_call_and_output_independent_of_the_drafter(pair, tokenizers, smaller):
    """speculative_generate takes the drafter's tokenizer; its greedy output is the target's whatever the drafter:
    a good one, a random one, one whose vocabulary has fewer merges (it spells words in more tokens)."""
    target, drafter = pair
    tt, dt = tokenizers
    prompt = tt.encode(TEXT[:40], add_special_tokens=False)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = autoregressive_generate(target, prompt, params, eos_token_ids=[]).output_ids
    fewer = translated(target, _bridge(smaller), noise=0.2)
    for method in ("string", "intersection"):
        for d, tok in ((drafter, dt), (random_llama(len(dt.hf), seed=9), dt), (fewer, smaller[1])):
            out, stats = speculative_generate(target, d, prompt, params, spec_length=4, eos_token_ids=[],
                                              tokenizer=tt, draft_tokenizer=tok, cross_tokenizer=method)
            assert out.output_ids == plain and stats.rounds


@pytest.mark.parametrize("method", ["string", "intersection"])
def test_structured_output_and_hybrid(pair, tokenizers, method):
    """Under a grammar (string-level drafts cut at the first forbidden token; intersection drafts drawn under the
    mask) and beside prompt lookup (proposer "hybrid"), greedy output is plain decoding's."""
    from infer.structured import StructuredOutput

    target, _ = pair
    tt, _ = tokenizers
    prompt = tt.encode("    a, b = 0, 1\n", add_special_tokens=False)
    plain = Engine(EngineConfig(model="target"), model=target, tokenizer=tt)
    for proposer in ("draft", "hybrid"):
        eng = _engine(pair, tokenizers, method, proposer=proposer)
        for spec in (StructuredOutput(regex=r"(a, b = [0-9a-z +]{1,12}\n){2,4}"), None):
            params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=spec is None, structured=spec)
            (a,) = plain.run([plain.add_request(prompt, params)])
            (b,) = eng.run([eng.add_request(prompt, params)])
            assert a.output_ids == b.output_ids and b.num_draft_tokens > 0, (proposer, spec)


# -- the joint law of a round's two tokens at temperature 1 -----------------------------------------------------
N = 1500
LATER = SamplingParams(temperature=1.0, max_tokens=4)


def _probs(target, seqs) -> torch.Tensor:
    V = target.config.vocab_size
    batch = SamplingBatch.from_params([LATER], V, "cpu").expand(len(seqs))
    with torch.no_grad():
        return logits_to_probs(target.compute_logits(target(torch.tensor(seqs)))[:, -1], batch, None)


def exact_joint(target, prompt) -> torch.Tensor:
    """P(x2, x3 | prompt) [V, V], x1 summed out; branches of probability < 1e-10 left out (mass < 1e-5)."""
    V = target.config.vocab_size
    p1 = _probs(target, [prompt])[0]
    x1 = [a for a in range(V) if p1[a] > 1e-10]
    p2 = _probs(target, [prompt + [a] for a in x1])  # [n1, V]
    joint = torch.zeros(V, V)
    pairs = [(i, b) for i, a in enumerate(x1) for b in range(V) if p1[a] * p2[i, b] > 1e-10]
    for s in range(0, len(pairs), 4096):
        chunk = pairs[s:s + 4096]
        p3 = _probs(target, [prompt + [x1[i], b] for i, b in chunk])
        w = torch.tensor([float(p1[x1[i]] * p2[i, b]) for i, b in chunk])
        joint.index_add_(0, torch.tensor([b for _, b in chunk]), w[:, None] * p3)
    return joint


def _pvalue(pair, tokenizers, method, backend, acceptance="exact"):
    target, drafter = pair
    tt, dt = tokenizers
    prompt = tt.encode("    for _ in", add_special_tokens=False)
    eng = Engine(EngineConfig(model="target", draft_model="drafter", cross_tokenizer=method, spec_length=2,
                              max_batch_size=32, block_size=4, seed=1234, kv_cache_backend=backend,
                              acceptance=acceptance), model=target, draft_model=drafter, tokenizer=tt,
                 draft_tokenizer=dt)
    reqs = eng.run([eng.add_request(prompt, LATER, eos_token_ids=[]) for _ in range(N)])
    V = target.config.vocab_size
    counts = torch.zeros(V, V)
    for r in reqs:
        counts[r.output_ids[1], r.output_ids[2]] += 1
    s = eng.stats
    assert s.num_draft_tokens > N and 0.1 < s.num_accepted_tokens / s.num_draft_tokens < 0.9  # rejections happen
    probs = exact_joint(target, prompt)
    assert counts[probs == 0].sum() == 0, "a zero-probability pair was generated"
    exp, obs = probs.flatten() * N, counts.flatten()
    big = exp >= 5  # sparse cells pooled
    o, e = torch.cat([obs[big], obs[~big].sum()[None]]), torch.cat([exp[big], exp[~big].sum()[None]])
    return chisquare(o.numpy(), e.numpy() * o.sum().item() / e.sum().item()).pvalue


@pytest.mark.parametrize("method,backend", [("string", "paged"), ("intersection", "contiguous")])
def test_joint_law_is_exact(pair, tokenizers, method, backend):
    assert _pvalue(pair, tokenizers, method, backend) > 0.001


@pytest.mark.parametrize("method", ["string", "intersection"])
def test_lossy_rule_is_caught(pair, tokenizers, method):
    assert _pvalue(pair, tokenizers, method, "paged", acceptance="skip_adjustment") < 1e-4

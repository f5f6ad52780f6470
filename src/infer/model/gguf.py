"""Read a llama.cpp GGUF checkpoint: a ModelConfig from its metadata, its tensors dequantized under HF names.

The loader (loader.py) does the rest exactly as for safetensors: shape check, q/k/v and gate/up fusion, load.
Three things differ from a Hugging Face checkpoint and are undone here:

* Shapes. GGUF lists dimensions in ggml order (fastest-varying first: a [out, in] weight is stored as
  ``ne = [in, out]``); ``gguf.quants.dequantize`` already returns the row-major logical array ``[out, in]``.
* Q/K rows. convert_hf_to_gguf.py reorders each head's rows from rotate-half pairing (i, i + D/2) to llama.cpp's
  interleaved pairing (2i, 2i + 1): ``w.reshape(n_head, 2, D/2, in).swapaxes(1, 2)``. ``unpermute_qk`` inverts it.
* Rope scaling. Llama 3.1-style scaling is stored as a per-frequency divisor table ``rope_freqs.weight``, not as
  parameters; ``rope_from_freq_factors`` recovers parameters that reproduce the table (or refuses).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property
from importlib.metadata import version
from pathlib import Path

import gguf
import numpy as np
import torch

from ..cachedir import cache_dir, write_atomic
from ..config import ModelConfig, RopeConfig

_Q = gguf.GGMLQuantizationType
_GGUF_VERSION = version("gguf")
SUPPORTED_TYPES = (_Q.F32, _Q.F16, _Q.BF16, _Q.Q8_0, _Q.Q4_0, _Q.Q4_1, _Q.Q5_0, _Q.Q5_1, _Q.Q2_K, _Q.Q3_K, _Q.Q4_K,
                   _Q.Q5_K, _Q.Q6_K)  # floats, legacy and K-quants (all tested); IQ*, TQ*, MXFP4 ... are refused



def _q4_1(b: torch.Tensor) -> torch.Tensor:  # blocks [n, 20]: d f16, m f16, 16 bytes of nibbles -> d * q + m
    return _nibbles(b[:, 4:]).float() * _f16(b[:, 0:2]) + _f16(b[:, 2:4])


def _q4_0(b: torch.Tensor) -> torch.Tensor:  # blocks [n, 18]: d f16, 16 bytes of nibbles -> d * (q - 8)
    return (_nibbles(b[:, 2:]).to(torch.int8) - 8).float() * _f16(b[:, 0:2])


def _q8_0(b: torch.Tensor) -> torch.Tensor:  # blocks [n, 34]: d f16, 32 int8 -> q * d
    return b[:, 2:].contiguous().view(torch.int8).float() * _f16(b[:, 0:2])


def _f16(b: torch.Tensor) -> torch.Tensor:  # [n, 2] bytes -> [n, 1] float32
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:  # [n, 16] bytes -> [n, 32]: low nibbles are 0..15, high 16..31
    return torch.cat([qs & 0x0F, qs >> 4], dim=1)


# The common block types dequantized by torch over whole tensors (both cores, no per-group Python) rather than by
# gguf's numpy code: SmolLM2's Q4_1 file in 0.23 s instead of 0.57 s of a warm start, the same float32 values (the same
# operations in the same order: tests/test_gguf.py checks them bit for bit against gguf's).
_TORCH_DEQUANT = {_Q.Q4_1: (20, _q4_1), _Q.Q4_0: (18, _q4_0), _Q.Q8_0: (34, _q8_0)}


def _torch_dequantize(data: np.ndarray, qtype) -> torch.Tensor:
    """``data``: a tensor's raw blocks, uint8 [..., row bytes] (a view of the memory map, not copied) -> float32
    [..., row elements]."""
    block_bytes, fn = _TORCH_DEQUANT[qtype]
    with warnings.catch_warnings():  # the map is read-only; nothing here writes to it
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.from_numpy(data)
    shape = data.shape[:-1] + (data.shape[-1] // block_bytes * 32,)
    return fn(raw.reshape(-1, block_bytes)).reshape(shape)


_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
          "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def gguf_file_of(path: str | os.PathLike) -> Path | None:
    """The GGUF file ``path`` denotes: itself if it is a .gguf file, or the one .gguf in a directory without a
    config.json (several there is a ValueError); None for anything else (a Hugging Face checkpoint directory)."""
    p = Path(path)
    if p.is_file():
        return p if p.suffix.lower() == ".gguf" else None
    if not p.is_dir() or (p / "config.json").is_file():
        return None
    found = sorted(f for f in p.iterdir() if f.suffix.lower() == ".gguf" and f.is_file())
    if len(found) > 1:
        raise ValueError(f"{p}: several .gguf files ({', '.join(f.name for f in found)}); pass the one to load")
    return found[0] if found else None


def hf_name(name: str) -> str | None:
    """GGUF tensor name -> Hugging Face Llama name: 'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'
    (None for any other name)."""
    if name in _GLOBAL:
        return _GLOBAL[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER:
        return f"model.layers.{parts[1]}.{_LAYER[parts[2]]}.{parts[3]}"
    return None


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's reordering (convert_hf_to_gguf.py): per head, rows (i, i + D/2) become rows (2i, 2i + 1)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of ``permute_qk``: view rows as [head, D/2, 2] and swap back to [head, 2, D/2]."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def rope_from_freq_factors(factors: np.ndarray, theta: float, head_dim: int,
                           original_context: int | None = None) -> RopeConfig:
    """Llama 3.1 rope parameters that reproduce llama.cpp's ``rope_freqs`` table (frequency i is divided by
    factors[i]); a ValueError if no such parameters exist.

    With u = 1 / wavelength, Llama 3.1 divides by ``factor`` below u_lo = low_freq_factor / original_context, by 1
    above u_hi = high_freq_factor / original_context, and in between by 1 / ((1 - s) / factor + s) with s linear in
    u, from 0 at u_lo to 1 at u_hi. Only u_lo and u_hi matter, so original_context is free: it is taken from the
    metadata when given, otherwise chosen so that low_freq_factor = 1 (Llama 3's value).
    """
    from .layers import rope_inv_freq

    ff = np.asarray(factors, dtype=np.float64).reshape(-1)
    if ff.shape != (head_dim // 2,) or not np.all(ff > 0):
        raise ValueError(f"rope_freqs.weight has {ff.size} entries; head_dim {head_dim} needs {head_dim // 2} > 0")
    if np.allclose(ff, 1.0, rtol=0, atol=1e-6):
        return RopeConfig(theta=theta)  # an identity table: plain rope
    u = (1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)) / (2 * math.pi)  # decreasing in i
    factor = float(ff.max())
    ones, full = np.abs(ff - 1) <= 1e-6, np.abs(ff - factor) <= 1e-6 * factor
    mid = ~ones & ~full
    s = (1 / ff[mid] - 1 / factor) / (1 - 1 / factor)
    a = u[full].max() if full.any() else 0.0  # u_lo lies in [a, first mid point), u_hi in (last mid point, b]
    b = u[ones].min() if ones.any() else 2 * u.max()
    if mid.sum() >= 2:  # s = alpha * u + beta through the band's points
        alpha, beta = np.polyfit(u[mid], s, 1)
        u_lo, u_hi = (-beta / alpha, (1 - beta) / alpha) if alpha > 0 else (1.0, 0.0)  # (1, 0): refused below
    elif mid.sum() == 1:  # one point: any line through it whose ends stay inside (a, b) reproduces the table
        u0, s0 = u[mid][0], s[0]
        t = min(u0 - a, (b - u0) * s0 / (1 - s0)) / 2
        u_lo, u_hi = u0 - t, u0 + t * (1 - s0) / s0
    else:  # a step: both ends anywhere between the last scaled and the first unscaled frequency
        u_lo, u_hi = a + (b - a) / 3, a + 2 * (b - a) / 3
    want = rope_inv_freq(head_dim, RopeConfig(theta=theta)).double() / torch.from_numpy(ff)
    if u_hi > u_lo > 0:
        orig = int(original_context or max(1, round(1 / u_lo)))
        rope = RopeConfig(theta=theta, type="llama3", factor=factor, low_freq_factor=orig * u_lo,
                          high_freq_factor=orig * u_hi, original_max_position_embeddings=orig)
        if torch.allclose(rope_inv_freq(head_dim, rope).double(), want, rtol=1e-5, atol=0):
            return rope
    raise ValueError("rope_freqs.weight does not follow Llama 3.1's rope scaling; infer cannot apply an arbitrary "
                     "per-frequency table")


@dataclass
class _Tensor:
    """What loading needs of one tensor: gguf's type, its ggml shape and its bytes (a view of the mapped file)."""

    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: np.ndarray
    data: np.ndarray


def _field_value(f):
    """A field as ``GGUFCheckpoint.field`` returns it: scalar, string, or an array's length."""
    kind = f.types[0]
    if kind == gguf.GGUFValueType.ARRAY:
        return len(f.data)
    if kind == gguf.GGUFValueType.STRING:
        return bytes(f.parts[f.data[0]]).decode("utf-8", errors="replace")
    return f.parts[f.data[0]][0].item()


class GGUFIndex:
    """The index of one GGUF file in the cache: {"key", "fields", "tensors"}; the key names the file (resolved path,
    size, times, inode), gguf's version and the index format, so a rewritten file or another reader is never served from
    it. A damaged or foreign entry is reported in one warning naming it and rebuilt; writes are atomic."""

    FORMAT = 1

    def __init__(self, file: Path):
        st = file.stat()
        self.key = {"format": self.FORMAT, "file": str(file.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                    "ctime_ns": st.st_ctime_ns, "inode": st.st_ino, "gguf": _GGUF_VERSION}
        digest = hashlib.sha256(json.dumps(self.key, sort_keys=True).encode()).hexdigest()[:24]
        self.path = cache_dir("gguf") / f"{file.stem}-{digest}.json"

    def load(self) -> dict | None:
        try:
            text = self.path.read_text()
        except OSError:
            return None
        try:
            entry = json.loads(text)
            if entry.get("key") != self.key:
                raise ValueError("it indexes another file or version")
            if not isinstance(entry["fields"], dict) or not all(len(t) == 6 for t in entry["tensors"]):
                raise ValueError("unexpected layout")
            return entry
        except (ValueError, KeyError, TypeError) as e:
            warnings.warn(f"GGUF index {self.path} is corrupt or stale ({type(e).__name__}: {e}); reading the file "
                          "anew", RuntimeWarning, stacklevel=3)
            return None

    def save(self, entry: dict) -> None:
        write_atomic(self.path, json.dumps({"key": self.key, **entry}))


class GGUFCheckpoint:
    """One .gguf file: ``config`` from the metadata (on first use), ``tensors()`` yields (where, HF name, load).

    gguf's reader parses every metadata array element by element (SmolLM2's 49k tokens and 48k merges: ~3 s), while
    loading needs only the scalars and where each tensor lies. Both are kept, once read, in a small index under
    ``$XDG_CACHE_HOME/infer/gguf`` (``GGUFIndex``); a later start maps the file and reads the tensors from there."""

    def __init__(self, file: str | os.PathLike):
        self.file = Path(file)
        index = GGUFIndex(self.file)
        entry = index.load()
        if entry is None:
            try:
                reader = gguf.GGUFReader(self.file)
            except (ValueError, OSError, IndexError) as e:
                raise ValueError(f"{self.file}: not a readable GGUF file ({e})") from None
            entry = {"fields": {k: _field_value(f) for k, f in reader.fields.items()},
                     "tensors": [[t.name, int(t.tensor_type), [int(n) for n in t.shape], list(t.data.shape),
                                  t.data.dtype.str, int(t.data_offset)] for t in reader.tensors]}
            index.save(entry)
        self.fields: dict = entry["fields"]
        data = np.memmap(self.file, mode="r")
        self.by_name = {name: _Tensor(name, _Q(kind), np.array(shape, dtype=np.uint32),
                                      np.ndarray(tuple(dshape), np.dtype(dtype), buffer=data, offset=offset))
                        for name, kind, shape, dshape, dtype, offset in entry["tensors"]}

    def field(self, key: str, default=None):
        """A scalar or string metadata value; arrays come back as their length."""
        return self.fields.get(key, default)

    def _required(self, key: str):
        value = self.field(key)
        if value is None:
            raise ValueError(f"GGUF metadata has no {key!r}")
        return value

    def eos_token_ids(self) -> list[int]:
        """End-of-sequence ids: eos, plus eot / eom where given (llama.cpp stops generating on all of them)."""
        ids = [self.field(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        return list(dict.fromkeys(int(i) for i in ids if i is not None))

    @cached_property
    def config(self) -> ModelConfig:
        try:
            return self._config()
        except ValueError as e:  # name the file once, whichever check refused it
            raise ValueError(f"{self.file.name}: {e}") from None

    def _config(self) -> ModelConfig:
        arch = self._required("general.architecture")
        if arch != "llama":
            raise ValueError(f"unsupported GGUF architecture {arch!r}; infer implements llama")
        a = lambda key: self.field(f"llama.{key}")  # noqa: E731
        need = lambda key: self._required(f"llama.{key}")  # noqa: E731
        if a("expert_count"):
            raise ValueError(f"a mixture-of-experts llama ({a('expert_count')} experts) is not supported")
        hidden, heads, ctx = need("embedding_length"), need("attention.head_count"), need("context_length")
        head_dim = a("rope.dimension_count") or hidden // heads
        if (a("attention.key_length") or head_dim) != head_dim:
            raise ValueError(f"rope.dimension_count {head_dim} differs from attention.key_length "
                             f"{a('attention.key_length')} (partial rotary is not supported)")
        theta = float(a("rope.freq_base") or 10000.0)
        scaling = a("rope.scaling.type") or "none"
        if scaling != "none" and float(a("rope.scaling.factor") or 1.0) != 1.0:
            raise ValueError(f"unsupported rope scaling type {scaling!r}; infer implements Llama 3.1 scaling "
                             "(a rope_freqs.weight tensor) only")
        rope = RopeConfig(theta=theta, original_max_position_embeddings=ctx)  # as config.json parsing defaults it
        if "rope_freqs.weight" in self.by_name:
            rope = rope_from_freq_factors(self.array("rope_freqs.weight"), theta, head_dim,
                                          a("rope.scaling.original_context_length"))
        vocab = a("vocab_size") or self.field("tokenizer.ggml.tokens")  # an array field: its length
        if not vocab and "token_embd.weight" in self.by_name:
            vocab = int(self.by_name["token_embd.weight"].shape[-1])  # ggml order: ne = [hidden, vocab]
        return ModelConfig(
            vocab_size=int(vocab or 0), hidden_size=hidden, intermediate_size=need("feed_forward_length"),
            num_hidden_layers=need("block_count"), num_attention_heads=heads,
            num_key_value_heads=a("attention.head_count_kv") or heads, head_dim=head_dim, max_position_embeddings=ctx,
            rms_norm_eps=float(a("attention.layer_norm_rms_epsilon") or 1e-5), rope=rope,
            tie_word_embeddings="output.weight" not in self.by_name,  # llama.cpp omits the head when it is tied
            attention_bias="blk.0.attn_q.bias" in self.by_name, mlp_bias="blk.0.ffn_up.bias" in self.by_name,
            bos_token_id=self.field("tokenizer.ggml.bos_token_id"), eos_token_ids=self.eos_token_ids(),
        )

    def array(self, name: str) -> np.ndarray:
        """One tensor dequantized to float32, in row-major logical order ([out, in] for a weight)."""
        t = self.by_name[name]
        if t.tensor_type not in SUPPORTED_TYPES:
            names = ", ".join(q.name for q in SUPPORTED_TYPES)
            raise ValueError(f"tensor {name!r} is stored as {t.tensor_type.name}, which infer cannot dequantize "
                             f"(supported: {names})")
        if t.tensor_type in _TORCH_DEQUANT:
            return _torch_dequantize(t.data, t.tensor_type).numpy()
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        return w if w.flags.writeable else w.copy()  # F32 comes back as a read-only view of the memory map

    def _load(self, name: str) -> torch.Tensor:
        try:
            w = self.array(name)
        except ValueError as e:
            raise ValueError(f"{self.file.name}: {e}") from None
        kind = name.split(".")[2] if name.startswith("blk.") else ""
        if kind in ("attn_q", "attn_k"):  # undo llama.cpp's row order (biases were permuted the same way)
            cfg = self.config
            w = unpermute_qk(w, cfg.num_attention_heads if kind == "attn_q" else cfg.num_key_value_heads)
        return torch.from_numpy(np.ascontiguousarray(w))

    def blocks(self, name: str) -> tuple[str, torch.Tensor] | None:
        """A weight's rows as the file stores them, for the block types infer's integer kernel reads as they are
        (Q8_0, Q4_0, Q4_1, Q4_K): (``"q4_1"`` ..., uint8 ``[out, row bytes]``, a view of the map unless q/k rows are put
        back in Hugging Face order); None for any other type or name."""
        t = self.by_name.get(name)
        kind = {_Q.Q8_0: "q8_0", _Q.Q4_0: "q4_0", _Q.Q4_1: "q4_1", _Q.Q4_K: "q4_k"}.get(t.tensor_type) \
            if t is not None else None
        if kind is None or t.data.ndim != 2:
            return None
        rows = t.data
        part = name.split(".")[2] if name.startswith("blk.") else ""
        if part in ("attn_q", "attn_k"):  # the row order of _load: whole rows move, blocks unchanged
            cfg = self.config
            rows = unpermute_qk(rows, cfg.num_attention_heads if part == "attn_q" else cfg.num_key_value_heads)
        with warnings.catch_warnings():  # the map is read-only; nothing writes to it
            warnings.simplefilter("ignore", UserWarning)
            return kind, torch.from_numpy(rows)

    def module_blocks(self, module: str) -> tuple[str, torch.Tensor] | None:
        """``blocks`` for one of our model's linear modules (``layers.3.self_attn.qkv_proj``, ``lm_head``), fused
        as the loader fuses it (rows concatenated) when all its parts share one block type; else None."""
        parts = module.split(".")
        if module == "lm_head":
            names = ["output.weight" if "output.weight" in self.by_name else "token_embd.weight"]
        elif len(parts) == 4 and parts[0] == "layers":
            i = parts[1]
            names = {"qkv_proj": ["attn_q", "attn_k", "attn_v"], "o_proj": ["attn_output"],
                     "gate_up_proj": ["ffn_gate", "ffn_up"], "down_proj": ["ffn_down"]}.get(parts[3], [])
            names = [f"blk.{i}.{n}.weight" for n in names]
        else:
            return None
        found = [self.blocks(n) for n in names]
        if not found or any(f is None or f[0] != found[0][0] for f in found):
            return None
        return found[0][0], found[0][1] if len(found) == 1 else torch.cat([f[1] for f in found])

    def tensors(self) -> Iterator[tuple[str, str, Callable[[], torch.Tensor]]]:
        """(where, HF name, load) per tensor; an unknown GGUF name is passed through for the loader to refuse."""
        for name in self.by_name:
            if name == "rope_freqs.weight":
                continue  # folded into config.rope
            yield f"{self.file.name} ({name})", hf_name(name) or name, lambda n=name: self._load(n)

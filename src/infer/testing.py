"""Tiny Hugging Face-format Llama checkpoints for tests and benchmarks, built offline.

``make_tiny_llama(dir, shape)`` writes config.json, generation_config.json, model.safetensors and a byte-level
BPE tokenizer (trained here with the ``tokenizers`` library, with a Llama-3-style chat template) using
transformers' own ``save_pretrained``, so the files are exactly what a real checkpoint looks like.
Weights are random but scaled so next-token distributions are peaked (greedy never sits on a near-tie).
Requires transformers (a test/benchmark dependency).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n
import os\nimport sys\nclass Cache:\n    def __init__(self, size):\n        self.size = size\n        self.items = {}\n
Speculative decoding drafts tokens with a small model and verifies them with a large one in a single pass.
The cat sat on the mat. Hello world! Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Caf\u00e9 na\u00efve \u00fcber \u4f60\u597d \U0001f600.
for i in range(10):\n    print(i * i)\nwhile True:\n    break\nif x == 1:\n    return None\nelse:\n    raise ValueError('bad')\n
"""

SHAPES: dict[str, dict] = {
    # plain multi-head attention, default rope, untied head, one EOS id
    "mha": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=4, tie_word_embeddings=False),
    # grouped-query attention with head_dim != hidden / heads
    "gqa": dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, tie_word_embeddings=False),
    # Llama 3.2 style: GQA, llama3 rope scaling, tied embeddings, a list of EOS ids
    "llama3": dict(hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
                   num_key_value_heads=1, tie_word_embeddings=True, rope_theta=50000.0,
                   rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                     original_max_position_embeddings=32),
                   eos_list=True),
    # tied embeddings on plain MHA
    "tied": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=2, tie_word_embeddings=True),
}


def build_tokenizer(vocab_size: int = 320, extra_specials: tuple[str, ...] = ()):
    """A byte-level BPE PreTrainedTokenizerFast with Llama-3 special tokens and chat template (deterministic).
    ``extra_specials``: special tokens placed first, which shifts every other id (a vocabulary of another model)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[*extra_specials, *SPECIALS],
                                  show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", bos)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>",
                                   eos_token="<|end_of_text|>", chat_template=CHAT_TEMPLATE)


def make_tiny_llama(out_dir: str | Path, shape: str = "gqa", seed: int = 0, vocab_size: int | None = None,
                    max_position_embeddings: int = 256, logit_scale: float = 4.0, **overrides) -> Path:
    """Write a random HF Llama checkpoint of a named ``shape`` (see SHAPES) into ``out_dir``; returns the path.

    ``vocab_size`` defaults to the tokenizer's size; a larger value pads the embedding with unused rows.
    ``logit_scale`` sets the spread of the output logits (larger -> more peaked next-token distributions).
    """
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    spec = {**SHAPES[shape], **overrides}
    eos_list = spec.pop("eos_list", False)
    rope_theta = spec.pop("rope_theta", 10000.0)
    rope_scaling = spec.pop("rope_scaling", None)
    tokenizer = build_tokenizer()
    n_tok = len(tokenizer)
    vocab = vocab_size or n_tok
    if vocab < n_tok:
        raise ValueError(f"vocab_size {vocab} < tokenizer size {n_tok}")
    bos, eos = tokenizer.convert_tokens_to_ids("<|begin_of_text|>"), tokenizer.convert_tokens_to_ids("<|end_of_text|>")
    eot = tokenizer.convert_tokens_to_ids("<|eot_id|>")
    eos_ids = [eos, eot] if eos_list else eos
    rope = {"rope_type": "default", "rope_theta": rope_theta}
    if rope_scaling:
        rope = {**rope_scaling, "rope_theta": rope_theta}
    cfg = LlamaConfig(vocab_size=vocab, max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-5,
                      bos_token_id=bos, eos_token_id=eos_ids, rope_parameters=rope, **spec)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).float()
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))  # non-trivial norm weights
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        # Final hidden states have RMS ~1, so a head row with norm ~logit_scale gives logits of std ~logit_scale:
        # peaked next-token distributions, but not one-hot.
        head = model.get_output_embeddings().weight
        head.copy_(torch.randn(head.shape, generator=g) * logit_scale / head.shape[1] ** 0.5)
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(bos_token_id=bos, eos_token_id=eos_ids).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def param_count(path: str | Path) -> int:
    with open(Path(path) / "config.json") as f:
        c = json.load(f)
    H, I, L, V = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    D = c.get("head_dim") or H // c["num_attention_heads"]
    attn = H * D * (2 * c["num_attention_heads"] + 2 * c["num_key_value_heads"])
    return L * (attn + 3 * H * I + 2 * H) + V * H * (1 if c.get("tie_word_embeddings") else 2) + H


def random_llama(vocab_size: int = 8, seed: int = 0, noise_from: int | None = None, noise: float = 0.0,
                 hidden_size: int = 32, num_layers: int = 2, logit_scale: float = 2.0,
                 intermediate_size: int | None = None):
    """An in-memory random Llama of our own class (no files, any vocabulary size), for distribution tests.

    With ``noise_from=s``, start from the weights of seed ``s`` and add Gaussian noise of relative size ``noise``:
    a drafter that resembles its target (moderate acceptance), as a distilled drafter would.
    """
    from .config import ModelConfig, RopeConfig
    from .model.llama import LlamaForCausalLM

    cfg = ModelConfig(vocab_size=vocab_size, hidden_size=hidden_size,
                      intermediate_size=intermediate_size or 2 * hidden_size,
                      num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=hidden_size // 4, max_position_embeddings=128, rms_norm_eps=1e-5, rope=RopeConfig(),
                      tie_word_embeddings=False, eos_token_ids=[])
    g = torch.Generator().manual_seed(seed if noise_from is None else noise_from)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        model.lm_head.weight.mul_(logit_scale)
        if noise_from is not None:
            gn = torch.Generator().manual_seed(seed)
            for p in model.parameters():
                p.add_(noise * p.abs().mean() * torch.randn(p.shape, generator=gn))
    return model.eval().requires_grad_(False)


def random_heads(target, kind: str, seed: int = 0, **kw):
    """An EAGLE-style, EAGLE-3 or Medusa-style head with random weights for ``target`` (model.draft_heads), attached
    to it: a poor but legitimate drafter, for losslessness tests of the proposers that draft from the target's states.
    The EAGLE-3 head reads the target's first, middle and last layers and drafts over all tokens but the last eighth
    (a draft vocabulary: q = 0 outside it)."""
    from .model.draft_heads import Eagle3Head, EagleHead, MedusaHeads

    if kind == "eagle3":
        L, V = target.config.num_hidden_layers, target.config.vocab_size
        head = Eagle3Head(target.config, tuple(sorted({0, L // 2, L - 1})), list(range(V - V // 8)), **kw)
    else:
        head = EagleHead(target.config, **kw) if kind == "eagle" else MedusaHeads(target.config, **kw)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.5 * torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return head.to(target.device, target.dtype).eval().requires_grad_(False).attach(target)


# --- a server in a process of its own (end-to-end tests) -------------------------------------------------------------
# The server runs in a session of its own, so stop_server reaches all it started (tensor-parallel workers, Ray's
# daemons and replicas), with stdout to /dev/null and stderr to a pipe: nothing it leaves behind holds the test run's
# own output open (a CI job waits for that to close). Its stderr is read only once it is stopped: reading a live
# server's stderr to its end waits forever.

def start_server(*args: str, env: dict | None = None) -> subprocess.Popen:
    """``python -m infer.server *args``."""
    return subprocess.Popen([sys.executable, "-m", "infer.server", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)


def stop_server(proc: subprocess.Popen, grace: float = 0.0) -> None:
    """SIGTERM the server and wait up to ``grace`` s for it; then SIGKILL whatever is left of its session."""
    if proc.poll() is None and grace > 0:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    # Ray's workers sit in process groups of their own, in the server's session; the server's own pid only while it
    # is unreaped (once reaped, the number may be another process's)
    for pid in _session(proc.pid) + ([proc.pid] if proc.poll() is None else []):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # exited already
    proc.wait(timeout=30)


def _session(sid: int) -> list[int]:
    """The processes of session ``sid`` (Linux /proc; elsewhere none: the server alone is stopped)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state ppid pgrp session
        except (OSError, IndexError):
            continue  # exited meanwhile
        if int(fields[3]) == sid and int(stat.parent.name) != sid:
            pids.append(int(stat.parent.name))
    return pids


def server_log(proc: subprocess.Popen, tail: int = 3000) -> str:
    """The end of a server's stderr, once it is stopped (an assertion's message when it does not come up)."""
    stop_server(proc)
    return proc.stderr.read()[-tail:] if proc.stderr else ""

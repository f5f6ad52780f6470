"""Train the shipped demo pair: a ~23M-parameter Llama target and a ~1.5M-parameter drafter distilled from it.

Data: the Python standard library's own source, which every machine has offline. About 2% of the modules are held
out of training (chosen by a hash of their path); they supply the evaluation prompts of `infer demo` and the
benchmarks. Stages, each resumable (its output or checkpoint is reused when present):

  1. tokenizer  byte-level BPE, vocabulary 8192, Llama-3-style special tokens      -> WORK/tokenizer
  2. tokens     every training file encoded, joined by <|end_of_text|>             -> WORK/train.u16, heldout.json
  3. target     next-token cross-entropy, bf16 autocast, AdamW + cosine schedule     -> WORK/target.pt
  4. drafter    distilled on the target's next-token distributions (forward KL)     -> WORK/drafter.pt
  4b. refine    the same distillation continued on fresh batches, a second cosine   -> WORK/drafter_refine.pt
  5. export     Hugging Face format (bf16 safetensors, config, tokenizer, card)     -> OUT/target, OUT/drafter
                plus the drafter's token ranking by training-split frequency        -> OUT/drafter/draft_vocab.json

Fixed seeds everywhere; batches are drawn from a generator seeded by (seed, step), so a resumed run sees exactly
the batches an uninterrupted one would.

    python scripts/train_demo_pair.py [--work ~/.cache/infer/demo-train] [--out src/infer/demo_models]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from infer.config import ModelConfig, RopeConfig
from infer.model.llama import LlamaForCausalLM
from infer.model.loader import save_model
from infer.proposers.draft_vocab import write_ranking

VOCAB = 8192
SEQ = 512
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"]
TARGET = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=8,
              num_key_value_heads=4, head_dim=64)
DRAFTER = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=32)


# -- data ---------------------------------------------------------------------------------------------------------
def corpus() -> tuple[list[Path], list[Path], Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    held = [p for p in files if int(hashlib.sha1(str(p.relative_to(root)).encode()).hexdigest(), 16) % 50 == 0]
    held_set = set(held)
    return [p for p in files if p not in held_set], held, root


def read(p: Path) -> str:
    return p.read_text(encoding="utf-8", errors="replace")


def stage_tokenizer(work: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    out = work / "tokenizer"
    if (out / "tokenizer.json").exists():
        return PreTrainedTokenizerFast.from_pretrained(out)
    train, _, _ = corpus()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS, show_progress=True,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((read(p) for p in train), trainer=trainer, length=len(train))
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                       special_tokens=[("<|begin_of_text|>", bos)])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>",
                                 pad_token="<|pad|>")
    hf.save_pretrained(out)
    return hf


def stage_tokens(work: Path, tok) -> np.ndarray:
    path = work / "train.u16"
    if path.exists():
        return np.fromfile(path, dtype=np.uint16)
    train, held, root = corpus()
    eos = tok.eos_token_id
    chunks = []
    for p in tqdm(train, desc="tokenize"):
        chunks.append(np.asarray(tok.encode(read(p), add_special_tokens=False) + [eos], dtype=np.uint16))
    data = np.concatenate(chunks)
    data.tofile(path)
    (work / "heldout.json").write_text(json.dumps([str(p.relative_to(root)) for p in held], indent=1))
    return data


def batch(data: np.ndarray, seed: int, step: int, bsz: int) -> torch.Tensor:
    g = np.random.default_rng([seed, step])
    starts = g.integers(0, len(data) - SEQ - 1, size=bsz)
    return torch.from_numpy(np.stack([data[s:s + SEQ + 1].astype(np.int64) for s in starts]))


# -- models -------------------------------------------------------------------------------------------------------
def make_model(shape: dict, tok, seed: int) -> LlamaForCausalLM:
    cfg = ModelConfig(vocab_size=VOCAB, max_position_embeddings=1024, rms_norm_eps=1e-5,
                      rope=RopeConfig(theta=10000.0), tie_word_embeddings=True, bos_token_id=tok.bos_token_id,
                      eos_token_ids=[tok.eos_token_id], **shape)
    torch.manual_seed(seed)
    m = LlamaForCausalLM(cfg)
    for name, p in m.named_parameters():
        if name.endswith("norm.weight"):
            torch.nn.init.ones_(p)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):  # residual branches scaled by depth
            torch.nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.num_hidden_layers))
        else:
            torch.nn.init.normal_(p, std=0.02)
    return m


def lr_at(step: int, total: int, peak: float, warmup: int = 50) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def train(name: str, model, data, work: Path, steps: int, bsz: int, peak_lr: float, seed: int,
          loss_fn, ckpt_every: int = 25):
    """Generic resumable loop: loss_fn(model, tokens[B, SEQ+1]) -> scalar loss."""
    ckpt = work / f"{name}.pt"
    opt = torch.optim.AdamW(model.parameters(), lr=peak_lr, betas=(0.9, 0.95), weight_decay=0.1)
    start, log = 0, []
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start, log = state["step"], state["log"]
    if start >= steps:
        return model, log
    model.train()
    bar = tqdm(range(start, steps), desc=name, initial=start, total=steps)
    t0 = time.time()
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, peak_lr)
        x = batch(data, seed, step, bsz)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn(model, x)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        log.append((step, float(loss)))
        tok_s = (step + 1 - start) * bsz * SEQ / (time.time() - t0)
        bar.set_postfix(loss=f"{float(loss):.3f}", tok_s=f"{tok_s:.0f}")
        if (step + 1) % ckpt_every == 0 or step + 1 == steps:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step + 1, "log": log},
                       ckpt.with_suffix(".tmp"))
            ckpt.with_suffix(".tmp").replace(ckpt)
    model.eval()
    return model, log


def lm_loss(model, x):
    logits = model.compute_logits(model(x[:, :-1]))
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))


def distill_loss(target):
    def fn(model, x):
        with torch.no_grad():
            p_log = target.compute_logits(target(x[:, :-1])).log_softmax(-1)
        q_log = model.compute_logits(model(x[:, :-1])).log_softmax(-1)
        # forward KL(p || q): the drafter learns to put mass where the target does (what acceptance rewards)
        return F.kl_div(q_log.reshape(-1, VOCAB), p_log.reshape(-1, VOCAB), log_target=True, reduction="batchmean")
    return fn


# -- checks and export --------------------------------------------------------------------------------------------
def repeated_4gram_share(ids: list[int]) -> float:
    grams = [tuple(ids[i:i + 4]) for i in range(len(ids) - 3)]
    return 1 - len(set(grams)) / len(grams) if grams else 0.0


@torch.inference_mode()
def sample_check(model, tok, prompt: str, n: int = 128) -> tuple[str, float]:
    from infer.generate import autoregressive_generate
    from infer.sampling import SamplingParams

    ids = tok.encode(prompt)[-256:]
    out = autoregressive_generate(model.float(), ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), [])
    return tok.decode(out.output_ids), repeated_4gram_share(out.output_ids)


@torch.inference_mode()
def heldout_loss(model, tok, held: list[Path], max_files: int = 8) -> float:
    losses = []
    for p in held[:max_files]:
        ids = tok.encode(read(p), add_special_tokens=False)[: SEQ + 1]
        if len(ids) < 64:
            continue
        x = torch.tensor([ids])
        losses.append(float(lm_loss(model.float(), x)))
    return sum(losses) / len(losses)


def write_prompts(out: Path, n: int = 8, chars: int = 1100) -> Path:
    """Held-out code snippets for the demo and benchmarks: ~chars of real code from unseen modules, cut at a line."""
    _, held, root = corpus()
    prompts = []
    for p in held:
        lines = read(p).splitlines(keepends=True)
        start = next((i for i, ln in enumerate(lines) if ln.startswith(("def ", "class ", "import ", "from "))), None)
        if start is None:
            continue
        text = ""
        for ln in lines[start:]:
            if len(text) + len(ln) > chars:
                break
            text += ln
        if len(text) > chars // 2:
            prompts.append({"module": str(p.relative_to(root)), "prompt": text})
        if len(prompts) == n:
            break
    path = out / "prompts.json"
    path.write_text(json.dumps(prompts, indent=1) + "\n")
    return path


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, default=Path.home() / ".cache" / "infer" / "demo-train")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "src" / "infer" / "demo_models")
    ap.add_argument("--target-steps", type=int, default=900)
    ap.add_argument("--drafter-steps", type=int, default=1000)
    ap.add_argument("--drafter-refine-steps", type=int, default=1000,
                    help="stage 4b: continue distilling the drafter for this many steps (0 = skip)")
    ap.add_argument("--drafter-refine-lr", type=float, default=1.5e-3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--stop-after", choices=["tokens", "target", "drafter", "export"], default="export")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    a.work.mkdir(parents=True, exist_ok=True)
    tok = stage_tokenizer(a.work)
    data = stage_tokens(a.work, tok)
    print(f"{len(data):,} training tokens")
    if a.stop_after == "tokens":
        return
    target, tlog = train("target", make_model(TARGET, tok, a.seed), data, a.work, a.target_steps, a.batch, 1.5e-3,
                         a.seed, lm_loss)
    _, held, root = corpus()
    print("target held-out loss", heldout_loss(target, tok, held))
    if a.stop_after == "target":
        return
    target = target.float().requires_grad_(False)
    drafter, dlog = train("drafter", make_model(DRAFTER, tok, a.seed + 1), data, a.work, a.drafter_steps, a.batch,
                          3e-3, a.seed + 1, distill_loss(target))
    if a.drafter_refine_steps:  # starts from the stage-4 weights with a fresh optimizer and its own batches
        drafter, dlog = train("drafter_refine", drafter, data, a.work, a.drafter_refine_steps, a.batch,
                              a.drafter_refine_lr, a.seed + 2, distill_loss(target))
    if a.stop_after == "drafter":
        return
    prompt = read(held[0])[:1200]
    text, rep = sample_check(target, tok, prompt)
    print(f"--- target sample (repeated 4-grams {rep:.2f}) ---\n{text}\n---")
    stats = {"target_params": sum(p.numel() for p in target.parameters()),
             "drafter_params": sum(p.numel() for p in drafter.parameters()),
             "training_tokens": int(len(data)), "target_steps": a.target_steps, "drafter_steps": a.drafter_steps,
             "drafter_refine_steps": a.drafter_refine_steps, "drafter_refine_peak_lr": a.drafter_refine_lr,
             "batch_tokens": a.batch * SEQ, "target_final_train_loss": sum(l for _, l in tlog[-20:]) / 20,
             "drafter_final_kl": sum(l for _, l in dlog[-20:]) / 20,
             "target_heldout_loss": heldout_loss(target, tok, held), "drafter_heldout_loss": heldout_loss(drafter, tok, held),
             "sample_repeated_4gram_share": rep, "heldout_modules": [str(p.relative_to(root)) for p in held]}
    for name, model in (("target", target), ("drafter", drafter)):
        save_model(model, a.out / name, dtype="bfloat16")
        tok.save_pretrained(a.out / name)
    write_ranking(a.out / "drafter", np.bincount(data, minlength=VOCAB).tolist(),
                  "token counts of the demo pair's training split (stdlib source), scripts/train_demo_pair.py",
                  recommended_size=2048)  # the fastest size in benchmarks/draft_vocab.py
    (a.out / "training.json").write_text(json.dumps(stats, indent=2) + "\n")
    write_prompts(a.out)
    print(json.dumps({k: v for k, v in stats.items() if k != "heldout_modules"}, indent=2))


if __name__ == "__main__":
    main()

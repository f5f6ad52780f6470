"""Train SmolLM2-135M-Instruct's drafters on the self-distillation data of scripts/drafter_data.py, and ship them.

    python scripts/drafter_data.py                      # the target's answers + teacher top-k / hidden states
    python scripts/train_drafters.py lm [--minutes 52]  # the distilled small LM  -> src/infer/drafters/smollm2-lm
    python scripts/train_drafters.py eagle              # the EAGLE-style head    -> src/infer/drafters/smollm2-eagle
    python scripts/train_drafters.py medusa             # Medusa-style heads      -> src/infer/drafters/smollm2-medusa
    python scripts/train_drafters.py eagle3             # the EAGLE-3 head        -> src/infer/drafters/smollm2-eagle3

Kinds (one subcommand each; every stage is resumable: a checkpoint in WORK is picked up where it stopped, and
batches come from a generator seeded by (seed, step), so a resumed run sees the batches an uninterrupted one would):

  lm      a small Llama sharing SmolLM2's tokenizer, distilled on the target's top-k next-token distributions
          (forward KL, what speculative acceptance rewards: sum min(p, q) grows as q covers p's mass). Its embedding
          (tied with its head) starts as the target's embedding projected on its top principal directions. The
          head is trained over the draft vocabulary (the answers' most frequent tokens, what the drafter scores at
          run time) and, on one position in eight, over the whole vocabulary, so that it stays a proper language
          model for transformers' assisted generation.
  eagle   the heads that draft from the target's hidden states (scripts/train_heads.py, which says how they
  medusa  are trained): they need the data's ``features`` stage as well (eagle3: its ``layers`` stage).
  eagle3

Training runs float32 on the CPU (bf16 matmuls are slower than f32 on AVX2 machines without AVX512-BF16) and is
bounded by wall time (--minutes) as well as steps. The export is bfloat16 safetensors in Hugging Face's Llama
format, with the tokenizer, the draft-vocabulary ranking and a card (README.md) of data, steps, wall time and
held-out agreement with the target.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from infer.model.llama import LlamaForCausalLM
from infer.model.loader import load_model, save_model
from infer.proposers.draft_vocab import write_ranking

DRAFTERS = Path(__file__).resolve().parents[1] / "src" / "infer" / "drafters"
MAXLEN = 512
FULL_VOCAB_EVERY = 8  # one position in eight is also scored over the whole vocabulary
LM_SHAPE = dict(hidden_size=192, intermediate_size=640, num_hidden_layers=4, num_attention_heads=3,
                num_key_value_heads=1, head_dim=64, max_position_embeddings=2048)


# -- data ---------------------------------------------------------------------------------------------------------
def load_answers(work: Path) -> list[dict]:
    """Conversations as training items: ``ids`` (the model's input, prompt + answer without its last token, at most
    MAXLEN: long prompts are cut from the left), ``sup`` (the input position whose output predicts each answer
    token) and the teacher's ``top_ids`` / ``top_logp`` [n_answer, k] for those answer tokens."""
    path = work / "answers.jsonl"
    if not path.exists():
        raise SystemExit(f"no {path}: run scripts/drafter_data.py first")
    items = []
    for line in path.open():
        r = json.loads(line)
        n = len(r["answer_ids"])
        if n == 0:
            continue
        ids = r["prompt_ids"] + r["answer_ids"][:-1]
        cut = max(0, len(ids) - MAXLEN)
        P = len(r["prompt_ids"]) - cut
        items.append({"ids": torch.tensor(ids[cut:]), "sup": torch.arange(P - 1, P - 1 + n),
                      "top_ids": torch.tensor(r["top_ids"]), "top_logp": torch.tensor(r["top_logp"]),
                      "answer": torch.tensor(r["answer_ids"]), "kind": r["kind"]})
    return items


def split(items: list[dict], frac: float = 0.03) -> tuple[list[dict], list[dict]]:
    """The last few conversations validate (their prompts come from the same pool as training; the evaluation
    prompts of the benchmark are held out entirely by drafter_data.py)."""
    n = max(1, int(len(items) * frac))
    return items[:-n], items[-n:]


def token_counts(items: list[dict], vocab: int) -> torch.Tensor:
    counts = torch.zeros(vocab, dtype=torch.long)
    for it in items:
        counts += torch.bincount(it["answer"], minlength=vocab)
    return counts


def collate(batch: list[dict]):
    """-> ids [B, T] (right-padded), (row, pos) of every supervised position, top_ids / top_logp [N, k]."""
    T = max(len(b["ids"]) for b in batch)
    ids = torch.stack([F.pad(b["ids"], (0, T - len(b["ids"]))) for b in batch])
    rows = torch.cat([torch.full((len(b["sup"]),), i) for i, b in enumerate(batch)])
    pos = torch.cat([b["sup"] for b in batch])
    return ids, rows, pos, torch.cat([b["top_ids"] for b in batch]), torch.cat([b["top_logp"] for b in batch])


def sample_batch(items: list[dict], seed: int, step: int, bsz: int) -> list[dict]:
    return random.Random(seed * 1_000_003 + step).sample(items, bsz)


# -- losses -------------------------------------------------------------------------------------------------------
def teacher_probs(top_logp: torch.Tensor) -> torch.Tensor:
    """The stored top-k log-probs, renormalised over the k: [N, k]."""
    return torch.softmax(top_logp.float(), dim=-1)


def kd_loss(hidden: torch.Tensor, head: torch.Tensor, sub_index: torch.Tensor, subset: torch.Tensor,
            top_ids: torch.Tensor, top_logp: torch.Tensor, gen: torch.Generator):
    """Forward KL to the teacher's top-k over the draft vocabulary, plus the whole vocabulary on 1/8 of positions.

    hidden [N, H] (final norm applied), head [V, H], sub_index [V] (position in the subset or -1), top_* [N, k].
    Returns (loss, agreement stats over the subset head).
    """
    p = teacher_probs(top_logp)  # [N, k]
    in_sub = sub_index[top_ids] >= 0  # [N, k]
    p_sub = p * in_sub
    p_sub = p_sub / p_sub.sum(-1, keepdim=True).clamp_min(1e-9)
    logq = torch.log_softmax(hidden @ head[subset].T, dim=-1)  # [N, S]
    lq = logq.gather(1, sub_index[top_ids].clamp_min(0))  # [N, k]
    loss = -(p_sub * lq).sum(-1).mean()
    pick = torch.rand(hidden.shape[0], generator=gen) < 1.0 / FULL_VOCAB_EVERY
    if pick.any():
        logq_full = torch.log_softmax(hidden[pick] @ head.T, dim=-1)  # [n, V]
        loss = loss + (-(p[pick] * logq_full.gather(1, top_ids[pick])).sum(-1).mean()) / FULL_VOCAB_EVERY
    with torch.no_grad():
        q = lq.exp()
        overlap = torch.minimum(p, q * in_sub).sum(-1)  # sum over the top-k of min(p, q): a sampled draft's acceptance, estimated
        top1 = (logq.argmax(-1) == sub_index[top_ids[:, 0]]).float()
    return loss, overlap, top1


# -- training loop ------------------------------------------------------------------------------------------------
def lr_at(step: int, total: int, peak: float, warmup: int = 100) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup)))))


def train_loop(name: str, module: torch.nn.Module, step_fn, eval_fn, work: Path, steps: int, minutes: float,
               peak_lr: float, seed: int, ckpt_every: int = 50, eval_every: int = 200):
    """step_fn(step) -> (loss, stats dict); eval_fn() -> dict. Stops at ``steps`` or after ``minutes`` of training
    (the time of earlier runs included), checkpointing on the way."""
    ckpt = work / f"{name}.pt"
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=peak_lr, betas=(0.9, 0.95), weight_decay=0.01)
    start, log, spent, best = 0, [], 0.0, {}
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start, log, spent, best = state["step"], state["log"], state["seconds"], state.get("best", {})
    bar = tqdm(range(start, steps), desc=name, initial=start, total=steps)
    t0 = time.perf_counter() - spent
    for step in bar:
        if time.perf_counter() - t0 > minutes * 60:
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, peak_lr)
        module.train()
        loss, stats = step_fn(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        entry = {"step": step, "loss": loss.item(), **stats}
        if (step + 1) % eval_every == 0:
            module.eval()
            entry["eval"] = eval_fn()
            tqdm.write(f"{name} step {step + 1}: {entry['eval']}")
            if entry["eval"]["overlap"] > best.get("overlap", -1.0):  # keep the best validated weights
                best = {"overlap": entry["eval"]["overlap"], "step": step + 1,
                        "model": {k: v.detach().clone() for k, v in module.state_dict().items()}}
        log.append(entry)
        bar.set_postfix(loss=f"{entry['loss']:.3f}", **{k: f"{v:.3f}" for k, v in stats.items()})
        if (step + 1) % ckpt_every == 0:
            torch.save({"model": module.state_dict(), "opt": opt.state_dict(), "step": step + 1, "log": log,
                        "seconds": time.perf_counter() - t0, "best": best}, ckpt.with_suffix(".tmp"))
            ckpt.with_suffix(".tmp").replace(ckpt)
    seconds = time.perf_counter() - t0
    torch.save({"model": module.state_dict(), "opt": opt.state_dict(), "step": len(log), "log": log,
                "seconds": seconds, "best": best}, ckpt.with_suffix(".tmp"))
    ckpt.with_suffix(".tmp").replace(ckpt)
    final, kept = eval_fn(), len(log)
    if best and best["overlap"] > final["overlap"]:
        tqdm.write(f"{name}: exporting step {best['step']} (validation {best['overlap']:.4f} > {final['overlap']:.4f})")
        module.load_state_dict(best["model"])
        kept = best["step"]
    module.eval()
    return log, seconds, kept


# -- the distilled LM ---------------------------------------------------------------------------------------------
def make_lm(target: LlamaForCausalLM, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = replace(target.config, **LM_SHAPE, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg)
    for name, p in model.named_parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.02)
        if name.endswith("o_proj.weight") or name.endswith("down_proj.weight"):
            p.data.mul_(1 / math.sqrt(2 * cfg.num_hidden_layers))
    # The embedding starts as the target's, projected on its top principal directions (std 0.02: tied, it is the head too, and starts with small logits).
    E = target.embed_tokens.weight.detach().float()
    _, _, V = torch.linalg.svd(E[torch.randperm(E.shape[0])[:8192]], full_matrices=False)
    proj = E @ V[: cfg.hidden_size].T
    model.embed_tokens.weight.data.copy_(proj * (0.02 / proj.std()))
    return model


def eval_lm(model, val, sub_index, subset) -> dict:
    gen = torch.Generator().manual_seed(0)
    overlaps, top1s = [], []
    with torch.no_grad():
        for i in range(0, len(val), 8):
            ids, rows, pos, top_ids, top_logp = collate(val[i:i + 8])
            h = model(ids)[rows, pos]
            _, ov, t1 = kd_loss(h, model.embed_tokens.weight, sub_index, subset, top_ids, top_logp, gen)
            overlaps.append(ov)
            top1s.append(t1)
    return {"overlap": float(torch.cat(overlaps).mean()), "top1": float(torch.cat(top1s).mean())}


def run_lm(args):
    from infer.demo import real_model_path

    items = load_answers(args.work)
    train, val = split(items)
    target = load_model(real_model_path(), dtype="float32")
    vocab = target.config.vocab_size
    counts = token_counts(train, vocab)
    subset = torch.argsort(counts, descending=True)[: args.subset]
    subset = torch.unique(torch.cat([subset, torch.tensor(target.config.eos_token_ids)]))  # sorted ascending
    sub_index = torch.full((vocab,), -1, dtype=torch.long)
    sub_index[subset] = torch.arange(len(subset))
    model = make_lm(target, args.seed)
    del target
    gen = torch.Generator().manual_seed(args.seed)
    n_tok = sum(len(it["answer"]) for it in train)
    print(f"lm: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, {len(train)} conversations "
          f"({n_tok} answer tokens) train, {len(val)} validate, subset {len(subset)}", file=sys.stderr)

    def step_fn(step):
        ids, rows, pos, top_ids, top_logp = collate(sample_batch(train, args.seed, step, args.batch))
        h = model(ids)[rows, pos]  # [N, H]
        loss, ov, t1 = kd_loss(h, model.embed_tokens.weight, sub_index, subset, top_ids, top_logp, gen)
        return loss, {"overlap": float(ov.mean()), "top1": float(t1.mean())}

    log, seconds, kept = train_loop("lm", model, step_fn, lambda: eval_lm(model, val, sub_index, subset),
                              args.work, args.steps, args.minutes, args.lr, args.seed)
    final = eval_lm(model, val, sub_index, subset)
    export_lm(model, args, counts, log, seconds, final, n_tok, len(train), kept)


def export_lm(model, args, counts, log, seconds, final, n_tok, n_conv, kept):
    from transformers import AutoTokenizer

    from infer.demo import real_model_path

    out = args.out or DRAFTERS / "smollm2-lm"
    save_model(model, out, dtype="bfloat16")
    cfg = json.loads((out / "config.json").read_text())
    cfg["infer_drafter"] = {"kind": "draft_model", "target": "SmolLM2-135M-Instruct"}
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    path = real_model_path()
    AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(str(out))
    write_ranking(out, counts.tolist(), "SmolLM2-135M-Instruct's answers to the drafter training prompts",
                  recommended_size=args.subset)
    steps = len(log)
    card = f"""# smollm2-lm: a distilled drafter for SmolLM2-135M-Instruct

An {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M-parameter Llama ({LM_SHAPE['num_hidden_layers']} layers,
hidden {LM_SHAPE['hidden_size']}, tied embeddings) sharing SmolLM2's 49,152-token tokenizer; bfloat16.
Loadable by transformers (`AutoModelForCausalLM.from_pretrained`) and by infer (`draft_model=...`).

- Data: scripts/drafter_data.py: SmolLM2-135M-Instruct's own answers (int8 weights, bf16, temperature 0.7, at most
  160 tokens) to {n_conv} chat and code prompts built offline from the Python standard library and instruction
  templates; the target's top-20 next-token distributions at every answer position ({n_tok} tokens), reported by the engine as it sampled.
- Training: scripts/train_drafters.py lm: forward KL to the teacher's top-20 (renormalised), over the {args.subset}-token draft
  vocabulary and on 1/{FULL_VOCAB_EVERY} of positions over the whole vocabulary; AdamW, peak lr {args.lr},
  batch {args.batch} conversations, {steps} steps, {seconds / 60:.0f} min wall time on 2 CPU cores (float32); the
  weights shipped are those of step {kept}, the best validation.
- Validation (answers of held-back conversations, teacher forcing): sum over the top-20 of min(p, q) =
  {final['overlap']:.3f} (an estimate of one sampled draft's acceptance rate, with p renormalised over its top 20), top-1 agreement {final['top1']:.3f}.
  Acceptance per draft position on held-out prompts: docs/benchmarks.md (benchmarks/drafters.py).
- Draft vocabulary: draft_vocab.json ranks every token by its count in the answers; recommended size
  {args.subset}.
"""
    (out / "README.md").write_text(card)
    (out / "training_log.json").write_text(json.dumps({"seconds": seconds, "steps": steps, "kept_step": kept,
                                                       "final": final,
                                                       "evals": [e for e in log if "eval" in e]}) + "\n")
    print(f"exported {out}: {final}", file=sys.stderr)


DEFAULTS = {  # kind -> the shipped run's settings (steps sized to what the minutes allow here)
    "lm": dict(steps=4200, minutes=52, batch=16, lr=3e-3, eval_every=200),
    "eagle": dict(steps=1500, minutes=24, batch=8, lr=1e-3, eval_every=100),
    "medusa": dict(steps=1200, minutes=10, batch=8, lr=1e-3, eval_every=100),
    "eagle3": dict(steps=3000, minutes=150, batch=8, lr=1e-3, eval_every=200),
}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kind", choices=sorted(DEFAULTS))
    ap.add_argument("--work", type=Path, default=Path.home() / ".cache" / "infer" / "drafter-data")
    ap.add_argument("--out", type=Path, default=None)
    for name, typ in (("steps", int), ("minutes", float), ("batch", int), ("lr", float), ("eval-every", int)):
        ap.add_argument(f"--{name}", type=typ, default=None, help="default: the kind's shipped run (DEFAULTS)")
    ap.add_argument("--subset", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    for k, v in DEFAULTS[args.kind].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    if args.kind == "lm":
        run_lm(args)
    elif args.kind == "eagle3":
        from train_heads import run_eagle3

        run_eagle3(args)
    else:
        from train_heads import run_heads

        run_heads(args)


if __name__ == "__main__":
    main()

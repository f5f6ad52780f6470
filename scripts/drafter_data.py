"""Self-distillation data for SmolLM2-135M-Instruct's drafters: the target's own answers and its view of them.

Everything is built offline and reproducibly (fixed seeds), in resumable stages:

  1. prompts   chat prompts built from the Python standard library (write / explain / rewrite a function, summarise
               a docstring) and from plain-English instruction templates over topic lists. Modules and topics are
               split by a hash: the held-out ones give the evaluation prompts (chat and code) that training never
               sees; they ship as src/infer/drafters/eval_prompts.json.           -> WORK/prompts.json
  2. answers   the target answers every training prompt through our engine, batched, at temperature 0.7 (the
               temperature users run; greedy data would teach only the argmax path) and, with --temperatures
               0.7,0, greedily as well (what greedy requests meet). -> WORK/answers.jsonl
               Every answer row also carries the target's top-20 next-token log-probabilities at each answer
               position, reported by the engine from the logits it computes anyway (the distilled LM's teacher).
  3. features  the target's last hidden state (final norm applied) at every position of every conversation, one
               teacher-forced float32 pass per batch (conversations sorted by length: little padding), stored as
               bfloat16 in shards of FEATURE_SHARD conversations -> WORK/features-NNN.pt. What the EAGLE-style
               and Medusa-style heads draft from. float32 rather than the engine's int8: an int8 pass over whole
               conversations costs ~4 s each here, float32 ~0.25 s; the heads then meet int8's features at run
               time (the benchmark measures them there).
  pack         the answers (token ids only) in data/drafter-answers/, 1,000 rows a file, to commit: a fresh machine
               restores them (prompts rebuilt, the teacher's top-20 recomputed by one teacher-forced pass) before
               answering more, so the data grows across sessions.
  4. layers    (EAGLE-3, issue 33) the outputs of the target's layers AUX_LAYERS (a low, a middle and a high one) at
               every position, bfloat16 (~3.5 KB a position) -> WORK/layers/*.pt, loaded memory-mapped by the
               trainer. The answers stage captures them as the engine computes them (the runner's feature sink:
               what the head meets at run time, from the same Q4_1 target); this stage teacher-forces the rows it
               did not (answered earlier, or restored), ~1 s a conversation here.

The target runs as the drafters will serve it (REAL_MODEL_SETTINGS: the GGUF's own Q4_1 blocks, bfloat16; the first
drafters' data came from int8 weights, the setting of its day).

    python scripts/drafter_data.py [--work ~/.cache/infer/drafter-data] [--num-train 3000] [--max-tokens 160] [--batch 32]
                                   [--stages prompts,answers,features,layers] [--temperatures 0.7,0]

Issue 33's data (the EAGLE-3 head): --num-train 7000 --temperatures 0.7,0 (every prompt answered at 0.7 and
greedily: 14,000 conversations), then --stages layers.
"""

from __future__ import annotations

import argparse
import ast
import gzip
import hashlib
import json
import random
import sys
import sysconfig
import textwrap
import time
from pathlib import Path

import torch
from tqdm import tqdm

EVAL_PROMPTS = Path(__file__).resolve().parents[1] / "src" / "infer" / "drafters" / "eval_prompts.json"
# The answers themselves (token ids), packed and committed, so that a later session (a fresh machine) resumes the data
# where an earlier one stopped: stage `pack` writes them, stage `answers` restores them first.
PACKED = Path(__file__).resolve().parents[1] / "data" / "drafter-answers"
PACK_ROWS = 1000
TOPK = 20  # the most the engine reports (SamplingParams.logprobs)
TEMPERATURE = 0.7
FEATURE_SHARD = 500  # conversations per features-NNN.pt / layers-NNN.pt
# EAGLE-3's choice for a Llama of N layers: the inputs of layers 2, N // 2 and N - 3, i.e. the outputs of these (N = 30)
AUX_LAYERS = (1, 14, 26)

TOPICS = """photosynthesis; the water cycle; black holes; volcanoes; the immune system; climate change; electricity;
magnets; the moon's phases; earthquakes; rainbows; gravity; DNA; vaccines; the stock market; inflation; compound
interest; budgeting; saving for retirement; starting a small business; job interviews; public speaking; time
management; learning a new language; writing a resume; negotiating a salary; remote work; team meetings; giving
feedback; making friends as an adult; healthy sleep; drinking enough water; running a first 5k; stretching; yoga;
meditation; cooking pasta; baking bread; making coffee; growing tomatoes; composting; keeping houseplants alive;
caring for a dog; adopting a cat; birdwatching; camping; hiking safety; packing for a trip; visiting Japan; train
travel in Europe; the Roman Empire; the printing press; the industrial revolution; ancient Egypt; the Renaissance;
the moon landing; the internet; smartphones; electric cars; solar panels; wind turbines; recycling; plastic
pollution; coral reefs; rainforests; deserts; penguins; honeybees; octopuses; whales; dinosaurs; chess; soccer;
basketball; the Olympics; jazz; learning the guitar; painting with watercolors; photography; writing poetry;
reading more books; libraries; museums; video games; board games; social media; online privacy; passwords;
email etiquette; spreadsheets; databases; cloud computing; open-source software; version control with git; unit
testing; code review; recursion; sorting algorithms; binary search; hash tables; linked lists; regular expressions;
the HTTP protocol; JSON; APIs; machine learning; neural networks; robots; 3D printing; space telescopes; Mars;
the speed of light; time zones; calendars; maps; weather forecasts; hurricanes; snow; autumn leaves; the ocean
tides; chocolate; tea; spices; vegetarian cooking; a healthy breakfast; grocery shopping on a budget; moving to a
new city; renting an apartment; fixing a leaky faucet; painting a room; decluttering; gardening in small spaces;
volunteering; kindness; gratitude; procrastination; motivation; curiosity; friendship; teamwork; leadership""".split(";")

CHAT_TEMPLATES = [
    "Explain {t} in simple terms.",
    "Give me three tips about {t}.",
    "Write a short poem about {t}.",
    "What are the pros and cons of {t}?",
    "Summarize what everyone should know about {t} in one paragraph.",
    "Write a short story for children that involves {t}.",
    "List five interesting facts about {t}.",
    "How would you explain {t} to a ten-year-old?",
    "Write a friendly email inviting a colleague to a talk about {t}.",
    "What are common mistakes people make with {t}?",
]
# More instruction shapes over the same topics (issue 33: 4x the data); a topic's split is the same for all of them.
MORE_CHAT_TEMPLATES = [
    "Write a haiku about {t}.",
    "What is the history of {t}? Keep it short.",
    "Give a beginner a step-by-step guide to {t}.",
    "Write a tweet that gets people excited about {t}.",
    "Compare {t} with something from everyday life.",
    "What questions should I ask an expert on {t}?",
    "Describe {t} in exactly three sentences.",
    "Write a short dialogue between two friends talking about {t}.",
    "What does the future of {t} look like?",
    "Explain {t} to someone who has never heard of it.",
    "Write a limerick about {t}.",
    "What are the biggest myths about {t}?",
    "Give me a quiz of three questions about {t}, with answers.",
    "Write an encouraging note to a friend who is struggling with {t}.",
    "Make a short to-do list for someone getting started with {t}.",
    "Why does {t} matter? Answer in a few bullet points.",
    "Write a product description for a book about {t}.",
    "Summarize the key ideas of {t} for a busy person.",
    "Write a short speech opening about {t}.",
    "What is one surprising thing about {t}?",
]
CODE_TEMPLATES = {
    "write": "Write a Python function `{name}{sig}` that does the following: {doc}",
    "explain": "Explain what this Python function does:\n```python\n{src}\n```",
    "rewrite": "Rewrite this Python function with clearer variable names and type hints:\n```python\n{src}\n```",
    "docstring": "Summarize this documentation in one sentence:\n{doc_full}",
}


def held_out(key: str, fraction: float = 0.05) -> bool:
    """A stable split by hash: the same key is held out on every machine."""
    return int(hashlib.sha1(key.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF < fraction


def stdlib_functions(max_src_lines: int = 30):
    """(module path, name, signature, first docstring paragraph, full docstring, source) of documented functions."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if any(part in rel for part in ("test", "idlelib", "site-packages", "lib2to3", "turtledemo")):
            continue
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = source.splitlines()
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if not doc or len(doc) < 40:
                continue
            src = "\n".join(lines[node.lineno - 1: node.end_lineno])
            src = None if node.end_lineno - node.lineno + 1 > max_src_lines else textwrap.dedent(src)
            sig = "(" + ast.unparse(node.args) + ")"
            first = doc.strip().split("\n\n")[0].replace("\n", " ")
            yield rel, node.name, sig, first, doc.strip()[:1200], src


def build_prompts(seed: int = 0, more: bool = True) -> tuple[list[dict], list[dict]]:
    """(train, eval): [{'kind': 'chat'|'code', 'source': ..., 'prompt': text}].

    ``more=False`` is the first drafters' set (issue 16): 10 chat templates, one random kind of code prompt per
    function; its held-out list is what eval_prompts.json was cut from. ``more=True`` (issue 33) adds
    MORE_CHAT_TEMPLATES and every kind of code prompt per function: the same split (by topic and module), so the
    held-out prompts stay unseen; its first prompts are the first set's."""
    rng = random.Random(seed)
    train, evals, extra = [], [], []
    for key in (t.strip() for t in TOPICS):
        # The split hashes the topic as first written (line breaks included), so it never moves; the prompt reads
        # it with single spaces. (The shipped drafter's data was made before that normalisation: 8 of its 141 topics
        # kept their line break in the training prompts.)
        topic = " ".join(key.split())
        for i, tmpl in enumerate(CHAT_TEMPLATES + (MORE_CHAT_TEMPLATES if more else [])):
            item = {"kind": "chat", "source": topic, "prompt": tmpl.format(t=topic)}
            if held_out("topic:" + key):
                (evals if i < len(CHAT_TEMPLATES) else []).append(item)
            else:
                (train if i < len(CHAT_TEMPLATES) else extra).append(item)
    for rel, name, sig, first, doc, src in stdlib_functions():
        options = ["write", "docstring"] + (["explain", "rewrite"] if src else [])
        kind = rng.choice(options)
        for k in [kind] + ([o for o in options if o != kind] if more else []):
            text = CODE_TEMPLATES[k].format(name=name, sig=sig, doc=first, doc_full=doc, src=src)
            item = {"kind": "code", "source": f"{rel}:{name}:{k}", "prompt": text}
            if held_out("module:" + rel):
                (evals if k == kind else []).append(item)
            else:
                (train if k == kind else extra).append(item)
    rng.shuffle(train)
    rng.shuffle(evals)
    return interleave(train) + interleave(extra, random.Random(seed + 1)), evals


def interleave(items: list[dict], rng: random.Random | None = None) -> list[dict]:
    """Alternate chat and code, so that any prefix of the list (--num-train) is about half of each."""
    if rng is not None:
        items = items[:]
        rng.shuffle(items)
    chat, code = [p for p in items if p["kind"] == "chat"], [p for p in items if p["kind"] == "code"]
    mixed = [p for pair in zip(chat, code) for p in pair]
    n = len(mixed) // 2
    return mixed + chat[n:] + code[n:]


def load_target(path: str | None = None, **kw):
    from infer.demo import real_model_path, REAL_MODEL_SETTINGS
    from infer.llm import LLM

    return LLM(path or real_model_path(), **{**REAL_MODEL_SETTINGS, **kw})


def answer_jobs(train: list[dict], num: int, temperatures: tuple[float, ...]) -> list[dict]:
    """Every prompt answered once at each temperature, in a fixed order (prompt by prompt): the answers file's row i
    is job i, so a killed run resumes at its first missing row."""
    return [{**p, "temperature": t} for p in train[:num] for t in temperatures]


def stage_answers(work: Path, train: list[dict], num: int, max_tokens: int, batch: int, seed: int,
                  temperatures: tuple[float, ...] = (TEMPERATURE,)):
    """Append answers to WORK/answers.jsonl, batch by batch: a killed run resumes where it stopped."""
    from infer.sampling import SamplingParams

    jobs = answer_jobs(train, num, temperatures)
    restore_packed(work, answer_jobs(train, len(train), temperatures))
    out = work / "answers.jsonl"
    done = sum(1 for _ in out.open()) if out.exists() else 0
    todo = jobs[done:]
    if not todo:
        return
    # Eager: 32 rows a step are past infer's few-row product kernels (compiling gains little) and eager starts at once
    # (no batched graphs to build). Attention takes infer's kernel at any batch (few tokens a row): a 32-row decode
    # step went from ~400 to ~190 ms when it stopped falling back to ATen's SDPA
    # Prefix caching: a prompt's later answers (other temperatures) are admitted once its first answer's prefill has
    # registered the prompt's blocks, and prefill only the last block (prefill is ~40% of the work here)
    llm = load_target(max_batch_size=batch, compile=False, enable_prefix_caching=True)
    tok = llm.tokenizer
    # The layers EAGLE-3 reads (stage 4), taken as the engine computes them: every prefill chunk's and decode step's
    # hidden states go through the runner's feature sink, the captured layers after the final state.
    H = llm.model.config.hidden_size
    llm.model.capture_layers(AUX_LAYERS)
    captured: dict[str, list] = {}
    llm.engine.runner.feature_sink = lambda r, start, h: captured.setdefault(r.request_id, []).append(
        (start, h[:, H:].to(torch.bfloat16).clone()))
    (work / "layers").mkdir(exist_ok=True)
    known: list[tuple[list[int], torch.Tensor]] = []  # recent rows' (prompt ids, layers): prefix-cache hits read them
    with out.open("a") as f, tqdm(total=len(jobs), initial=done, desc="answers", unit="answer") as bar:
        for start in range(0, len(todo), batch):
            chunk = todo[start:start + batch]
            ids = [tok.apply_chat_template([{"role": "user", "content": p["prompt"]}]) for p in chunk]
            # logprobs=TOPK: the engine reports the target's raw top-k next-token log-probs at every answer
            # position it samples, from the logits it computes anyway (no second pass over the answers).
            params = [SamplingParams(temperature=p["temperature"], max_tokens=max_tokens, logprobs=TOPK,
                                     seed=seed + done + start + i) for i, p in enumerate(chunk)]
            first = [i for i, p in enumerate(chunk) if p["temperature"] == temperatures[0]]
            rest = [i for i in range(len(chunk)) if i not in first]
            reqs: list = [None] * len(chunk)
            steps: dict = {}
            for part in (first, rest):
                for i, r in zip(part, llm.make_requests([ids[i] for i in part], [params[i] for i in part])):
                    reqs[i], steps[r.request_id] = r, []
                # step until this part's prompts are prefilled (their blocks cached), or everything is done
                while llm.engine.has_unfinished and (part is rest or any(
                        reqs[i].num_computed < len(reqs[i].prompt_ids) for i in part)):
                    for o in llm.engine.step():
                        steps[o.request_id].append(o)
            layers = {}
            for n, (i, r) in enumerate(zip(ids, reqs)):
                parts = sorted(captured.pop(r.request_id, []), key=lambda x: x[0])
                # positions served from the prefix cache (the chat template's system block; all of a prompt but
                # its last block for a later answer of the same prompt) were computed for an earlier row from the
                # same tokens: its layers there are this row's
                cached = parts[0][0] if parts else 0
                head = [] if cached == 0 else next(([h[:cached]] for ids0, h in reversed(known)
                                                    if len(h) >= cached and ids0[:cached] == i[:cached]), None)
                if head is None or not parts:
                    continue
                rows_h = torch.cat(head + [h for _, h in parts])
                if len(rows_h) == len(i) + len(r.output_ids) - 1:
                    layers[done + start + n] = rows_h
                    known.append((i, rows_h))
            del known[:-2 * batch]
            torch.save(layers, work / "layers" / f"gen-{done + start:06d}.pt")
            for p, i, r in zip(chunk, ids, reqs):
                outs = [o for o in steps[r.request_id] if o.token_id is not None]
                f.write(json.dumps({**p, "prompt_ids": i, "answer_ids": [o.token_id for o in outs],
                                    "top_ids": [[t for t, _ in o.top_logprobs] for o in outs],
                                    "top_logp": [[round(v, 4) for _, v in o.top_logprobs] for o in outs],
                                    "finish_reason": r.finish_reason}) + "\n")
            f.flush()
            bar.update(len(chunk))


def stage_pack(work: Path) -> None:
    """PACKED/answers-NNN.jsonl.gz: every complete run of PACK_ROWS rows of WORK/answers.jsonl, their answers only
    (job index, temperature, answer ids, finish reason; ~0.3 MB a file): what a fresh machine cannot recompute
    cheaply. The prompts are rebuilt by build_prompts, the teacher's top-20 by one teacher-forced pass (restore)."""
    rows = [json.loads(line) for line in (work / "answers.jsonl").open()] if (work / "answers.jsonl").exists() else []
    PACKED.mkdir(parents=True, exist_ok=True)
    for n in range(len(rows) // PACK_ROWS):
        path = PACKED / f"answers-{n:03d}.jsonl.gz"
        if path.exists() and sum(1 for _ in gzip.open(path, "rt")) == PACK_ROWS:  # a partial one is completed
            continue
        with gzip.open(path.with_suffix(".tmp"), "wt") as f:
            for i in range(n * PACK_ROWS, (n + 1) * PACK_ROWS):
                r = rows[i]
                f.write(json.dumps({"job": i, "source": r["source"], "temperature": r.get("temperature", TEMPERATURE),
                                    "answer_ids": r["answer_ids"], "finish_reason": r["finish_reason"]}) + "\n")
        path.with_suffix(".tmp").rename(path)


def restore_packed(work: Path, jobs: list[dict], batch: int = 8) -> int:
    """Rows of PACKED beyond WORK/answers.jsonl appended to it, with their prompts (jobs: build_prompts' order) and
    the teacher's top-20 at every answer position from one teacher-forced pass of the served target (bfloat16, its
    Q4_1 blocks: the engine's prefill numerics rather than its decode's). The same pass captures the layers EAGLE-3
    reads (AUX_LAYERS), FEATURE_SHARD rows a file in WORK/layers/rs-NNN.pt, so stage `layers` has nothing left to
    teacher-force for them (it did, at ~1 s a conversation). Returns the rows restored."""
    from infer.demo import real_model_path, REAL_MODEL_SETTINGS
    from infer.model.loader import load_model
    from infer.model.quant import quantize_model
    from infer.tokenizer import Tokenizer

    out = work / "answers.jsonl"
    done = sum(1 for _ in out.open()) if out.exists() else 0
    packed = []
    for path in sorted(PACKED.glob("answers-*.jsonl.gz")):
        with gzip.open(path, "rt") as f:
            packed += [json.loads(line) for line in f]
    todo = [r for r in packed if r["job"] >= done]
    if not todo or todo[0]["job"] != done:
        return 0
    model = load_model(real_model_path(), torch.bfloat16, torch.device("cpu"))
    quantize_model(model, REAL_MODEL_SETTINGS["quantization"])
    model.capture_layers(AUX_LAYERS)  # forward -> [final state; the captured layers], compute_logits reads the first
    H = model.config.hidden_size
    tok = Tokenizer(real_model_path())
    (work / "layers").mkdir(exist_ok=True)
    layers: dict[int, torch.Tensor] = {}

    def save_layers():  # after the rows' answers: rows whose layers a killed run lost are left to stage `layers`
        if layers:
            path = work / "layers" / f"rs-{min(layers):06d}.pt"
            torch.save(dict(layers), path.with_suffix(".tmp"))
            path.with_suffix(".tmp").rename(path)
            layers.clear()

    with out.open("a") as f, tqdm(total=len(todo), desc="restoring packed answers", unit="answer") as bar:
        for start in range(0, len(todo), batch):
            part = todo[start:start + batch]
            for r in part:
                job = jobs[r["job"]]
                if job["source"] != r["source"]:
                    raise SystemExit(f"packed row {r['job']} is for {r['source']!r}, the prompt list has "
                                     f"{job['source']!r} there: a different prompt set (--first-set?)")
            prompts = [tok.apply_chat_template([{"role": "user", "content": jobs[r["job"]]["prompt"]}]) for r in part]
            seqs = [p + r["answer_ids"][:-1] for p, r in zip(prompts, part)]
            T = max(len(x) for x in seqs)
            x = torch.zeros(len(part), T, dtype=torch.long)
            for j, q in enumerate(seqs):
                x[j, :len(q)] = torch.tensor(q)
            with torch.inference_mode():
                hidden = model(x)
                for j, (p, r) in enumerate(zip(prompts, part)):
                    n = len(r["answer_ids"])
                    layers[r["job"]] = hidden[j, :len(seqs[j]), H:].clone()  # [prompt + answer - 1, 3 H]
                    logp = model.compute_logits(hidden[j, len(p) - 1: len(p) - 1 + n]).log_softmax(-1)
                    vals, ids = logp.topk(TOPK)
                    f.write(json.dumps({**jobs[r["job"]], "temperature": r["temperature"], "prompt_ids": p,
                                        "answer_ids": r["answer_ids"], "top_ids": ids.tolist(),
                                        "top_logp": [[round(v, 4) for v in row] for row in vals.tolist()],
                                        "finish_reason": r["finish_reason"], "restored": True}) + "\n")
            f.flush()
            bar.update(len(part))
            if len(layers) >= FEATURE_SHARD:
                save_layers()
    save_layers()
    return len(todo)


def stage_features(work: Path, batch: int = 8):
    """WORK/features-NNN.pt: {row index in answers.jsonl: bfloat16 [prompt + answer - 1, hidden]}, shard by shard
    (a killed run resumes at the first missing shard)."""
    from infer.demo import real_model_path
    from infer.model.loader import load_model

    rows = [json.loads(line) for line in (work / "answers.jsonl").open()]
    ids = [r["prompt_ids"] + r["answer_ids"][:-1] for r in rows]  # the last token's state predicts nothing stored
    model = None
    shards = range(0, len(ids), FEATURE_SHARD)
    for n, start in enumerate(tqdm(shards, desc="feature shards")):
        path = work / f"features-{n:03d}.pt"
        if path.exists():
            continue
        model = model or load_model(real_model_path(), torch.float32, torch.device("cpu"))
        idx = sorted(range(start, min(start + FEATURE_SHARD, len(ids))), key=lambda i: len(ids[i]))
        out = {}
        for b in range(0, len(idx), batch):
            part = idx[b:b + batch]
            T = max(len(ids[i]) for i in part)
            x = torch.zeros(len(part), T, dtype=torch.long)
            for j, i in enumerate(part):
                x[j, :len(ids[i])] = torch.tensor(ids[i])
            with torch.inference_mode():
                h = model(x)  # [b, T, H]: causal, so right padding changes nothing before it
            for j, i in enumerate(part):
                out[i] = h[j, :len(ids[i])].to(torch.bfloat16).clone()
        torch.save(out, path.with_suffix(".tmp"))
        path.with_suffix(".tmp").rename(path)


def covered_rows(work: Path) -> set[int]:
    """Rows of answers.jsonl whose captured layers are stored in WORK/layers/*.pt (captured while answering, or by
    teacher forcing)."""
    rows = set()
    for path in sorted((work / "layers").glob("*.pt")):
        rows |= set(torch.load(path, mmap=True, weights_only=True))
    return rows


def stage_layers(work: Path, batch: int = 8):
    """WORK/layers/tf-NNN.pt: {row index in answers.jsonl: bfloat16 [prompt + answer - 1, 3 H]}, the outputs of
    AUX_LAYERS at every position (model.llama: capture_layers) for the rows the answers stage did not capture
    (rows answered before it captured them, rows restored from the packed answers), by one teacher-forced pass of
    the served target per batch, FEATURE_SHARD rows a file (resumable: rows already covered are skipped)."""
    from infer.demo import real_model_path, REAL_MODEL_SETTINGS
    from infer.model.loader import load_model
    from infer.model.quant import quantize_model

    rows = [json.loads(line) for line in (work / "answers.jsonl").open()]
    ids = [r["prompt_ids"] + r["answer_ids"][:-1] for r in rows]
    (work / "layers").mkdir(exist_ok=True)
    todo = sorted(set(range(len(ids))) - covered_rows(work))
    model = None
    n0 = len(list((work / "layers").glob("tf-*.pt")))
    for n, start in enumerate(tqdm(range(0, len(todo), FEATURE_SHARD), desc="layer files")):
        if model is None:
            model = load_model(real_model_path(), torch.bfloat16, torch.device("cpu"))
            quantize_model(model, REAL_MODEL_SETTINGS["quantization"])
            model.capture_layers(AUX_LAYERS)
            del model.layers[max(AUX_LAYERS) + 1:]  # nothing after the last captured layer is needed
        H = model.config.hidden_size
        idx = sorted(todo[start:start + FEATURE_SHARD], key=lambda i: len(ids[i]))
        out = {}
        for b in range(0, len(idx), batch):
            part = idx[b:b + batch]
            T = max(len(ids[i]) for i in part)
            x = torch.zeros(len(part), T, dtype=torch.long)
            for j, i in enumerate(part):
                x[j, :len(ids[i])] = torch.tensor(ids[i])
            with torch.inference_mode():
                h = model(x)[..., H:]  # [b, T, 3H]: causal, so right padding changes nothing before it
            for j, i in enumerate(part):
                out[i] = h[j, :len(ids[i])].clone()
        path = work / "layers" / f"tf-{n0 + n:03d}.pt"
        torch.save(out, path.with_suffix(".tmp"))
        path.with_suffix(".tmp").rename(path)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path.home() / ".cache" / "infer" / "drafter-data")
    ap.add_argument("--num-train", type=int, default=3000)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stages", default="prompts,answers")
    ap.add_argument("--temperatures", default="0.7", help="answer every prompt once at each (issue 33: 0.7,0)")
    ap.add_argument("--first-set", action="store_true", help="the first drafters' prompt set (issue 16)")
    args = ap.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    stages = args.stages.split(",")
    t0 = time.perf_counter()
    train, evals = build_prompts(args.seed, more=not args.first_set)
    if "prompts" in stages:
        (args.work / "prompts.json").write_text(json.dumps({"train": train, "eval": evals}))
    if "prompts" in stages and args.first_set:  # the shipped held-out prompts were cut from the first set's
        EVAL_PROMPTS.parent.mkdir(parents=True, exist_ok=True)
        chat = [e for e in evals if e["kind"] == "chat"][:24]
        code = [e for e in evals if e["kind"] == "code"][:24]
        EVAL_PROMPTS.write_text(json.dumps({"note": "held out of drafter training by scripts/drafter_data.py",
                                            "chat": chat, "code": code}, indent=1) + "\n")
        print(f"prompts: {len(train)} train, {len(evals)} held out", file=sys.stderr)
    if "answers" in stages:
        stage_answers(args.work, train, args.num_train, args.max_tokens, args.batch, args.seed,
                      tuple(float(t) for t in args.temperatures.split(",")))
    if "pack" in stages:
        stage_pack(args.work)
    if "features" in stages:
        stage_features(args.work)
    if "layers" in stages:
        stage_layers(args.work)
    print(f"done in {time.perf_counter() - t0:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()

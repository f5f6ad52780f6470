"""Self-distillation data for SmolLM2-135M-Instruct's drafters: the target's own answers and its view of them.

Everything is built offline and reproducibly (fixed seeds), in resumable stages:

  1. prompts   chat prompts built from the Python standard library (write / explain / rewrite a function, summarise
               a docstring) and from plain-English instruction templates over topic lists. Modules and topics are
               split by a hash: the held-out ones give the evaluation prompts (chat and code) that training never
               sees; they ship as src/infer/drafters/eval_prompts.json.           -> WORK/prompts.json
  2. answers   the target answers every training prompt through our engine, batched, at temperature 0.7 (the
               temperature users run; greedy data would teach only the argmax path). -> WORK/answers.jsonl
               Every answer row also carries the target's top-20 next-token log-probabilities at each answer
               position, reported by the engine from the logits it computes anyway (the distilled LM's teacher).
  3. features  the target's last hidden state (final norm applied) at every position of every conversation, one
               teacher-forced float32 pass per batch (conversations sorted by length: little padding), stored as
               bfloat16 in shards of FEATURE_SHARD conversations -> WORK/features-NNN.pt. What the EAGLE-style
               and Medusa-style heads draft from. float32 rather than the engine's int8: an int8 pass over whole
               conversations costs ~4 s each here, float32 ~0.25 s; the heads then meet int8's features at run
               time (the benchmark measures them there).

The target runs at its fastest plain setting (bfloat16 weights, int8 weight-only), as the drafters will serve it.

    python scripts/drafter_data.py [--work ~/.cache/infer/drafter-data] [--num-train 3000] [--max-tokens 160] [--batch 32]
                                   [--stages prompts,answers,features]
"""

from __future__ import annotations

import argparse
import ast
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
TOPK = 20  # the most the engine reports (SamplingParams.logprobs)
TEMPERATURE = 0.7
FEATURE_SHARD = 500  # conversations per features-NNN.pt

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


def build_prompts(seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(train, eval): [{'kind': 'chat'|'code', 'source': ..., 'prompt': text}]."""
    rng = random.Random(seed)
    train, evals = [], []
    for key in (t.strip() for t in TOPICS):
        # The split hashes the topic as first written (line breaks included), so it never moves; the prompt reads
        # it with single spaces. (The shipped drafter's data was made before that normalisation: 8 of its 141 topics
        # kept their line break in the training prompts.)
        topic = " ".join(key.split())
        for tmpl in CHAT_TEMPLATES:
            item = {"kind": "chat", "source": topic, "prompt": tmpl.format(t=topic)}
            (evals if held_out("topic:" + key) else train).append(item)
    for rel, name, sig, first, doc, src in stdlib_functions():
        options = ["write", "docstring"] + (["explain", "rewrite"] if src else [])
        kind = rng.choice(options)
        text = CODE_TEMPLATES[kind].format(name=name, sig=sig, doc=first, doc_full=doc, src=src)
        item = {"kind": "code", "source": f"{rel}:{name}:{kind}", "prompt": text}
        (evals if held_out("module:" + rel) else train).append(item)
    rng.shuffle(train)
    rng.shuffle(evals)
    # Alternate chat and code, so that any prefix of the training list (--num-train) is about half of each.
    chat, code = [p for p in train if p["kind"] == "chat"], [p for p in train if p["kind"] == "code"]
    mixed = [p for pair in zip(chat, code) for p in pair]
    n = len(mixed) // 2
    return mixed + chat[n:] + code[n:], evals


def load_target(path: str | None = None, **kw):
    from infer.demo import real_model_path, REAL_MODEL_SETTINGS
    from infer.llm import LLM

    return LLM(path or real_model_path(), **{**REAL_MODEL_SETTINGS, **kw})


def stage_answers(work: Path, train: list[dict], num: int, max_tokens: int, batch: int, seed: int):
    """Append answers to WORK/answers.jsonl, batch by batch: a killed run resumes where it stopped."""
    from infer.sampling import SamplingParams

    out = work / "answers.jsonl"
    done = sum(1 for _ in out.open()) if out.exists() else 0
    todo = train[done:num]
    if not todo:
        return
    llm = load_target(max_batch_size=batch)
    tok = llm.tokenizer
    with out.open("a") as f, tqdm(total=num, initial=done, desc="answers", unit="prompt") as bar:
        for start in range(0, len(todo), batch):
            chunk = todo[start:start + batch]
            ids = [tok.apply_chat_template([{"role": "user", "content": p["prompt"]}]) for p in chunk]
            # logprobs=TOPK: the engine reports the target's raw top-k next-token log-probs at every answer
            # position it samples, from the logits it computes anyway (no second pass over the answers).
            params = [SamplingParams(temperature=TEMPERATURE, max_tokens=max_tokens, logprobs=TOPK,
                                     seed=seed + done + start + i) for i in range(len(chunk))]
            reqs = llm.make_requests(ids, params)
            steps = {r.request_id: [] for r in reqs}
            while llm.engine.has_unfinished:
                for o in llm.engine.step():
                    steps[o.request_id].append(o)
            for p, i, r in zip(chunk, ids, reqs):
                outs = [o for o in steps[r.request_id] if o.token_id is not None]
                f.write(json.dumps({**p, "prompt_ids": i, "answer_ids": [o.token_id for o in outs],
                                    "top_ids": [[t for t, _ in o.top_logprobs] for o in outs],
                                    "top_logp": [[round(v, 4) for _, v in o.top_logprobs] for o in outs],
                                    "finish_reason": r.finish_reason}) + "\n")
            f.flush()
            bar.update(len(chunk))


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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path.home() / ".cache" / "infer" / "drafter-data")
    ap.add_argument("--num-train", type=int, default=3000)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stages", default="prompts,answers")
    args = ap.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    stages = args.stages.split(",")
    t0 = time.perf_counter()
    train, evals = build_prompts(args.seed)
    if "prompts" in stages:
        (args.work / "prompts.json").write_text(json.dumps({"train": train, "eval": evals}))
        EVAL_PROMPTS.parent.mkdir(parents=True, exist_ok=True)
        chat = [e for e in evals if e["kind"] == "chat"][:24]
        code = [e for e in evals if e["kind"] == "code"][:24]
        EVAL_PROMPTS.write_text(json.dumps({"note": "held out of drafter training by scripts/drafter_data.py",
                                            "chat": chat, "code": code}, indent=1) + "\n")
        print(f"prompts: {len(train)} train, {len(evals)} held out", file=sys.stderr)
    if "answers" in stages:
        stage_answers(args.work, train, args.num_train, args.max_tokens, args.batch, args.seed)
    if "features" in stages:
        stage_features(args.work)
    print(f"done in {time.perf_counter() - t0:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()

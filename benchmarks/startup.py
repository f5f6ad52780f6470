"""Start-up: process start -> ready and -> first streamed token, cold (empty caches) and warm (caches filled).

Real processes, as a user starts them, on SmolLM2-135M-Instruct with each command's default speculation:

  chat   ``infer chat --model <SmolLM2 gguf>`` with a prompt on stdin: ready = its banner, first token = the first
         byte of the reply
  demo   ``infer demo --max-tokens 16``: ready = its "[ready in" line, first token = the first byte of the first reply
  serve  ``infer serve --model <SmolLM2 gguf>``: ready = GET /health answers, first token = the first content chunk
         of a streamed chat completion sent at once

Cold: every run gets an empty ``XDG_CACHE_HOME`` (infer's kernels, tokenizer, cost profiles and torch's compile
caches all live there). Warm: one directory filled beforehand by processes that build every graph and profile
(``Engine.wait_until_ready``) with each command's own settings, then used by every warm run. A cold process is
stopped after its first token; a warm one once its stderr says the background compiling is done (full speed: how
long a warm start runs eagerly first). 3 runs per cell (median, min, max).

    python benchmarks/startup.py [--runs 3]

Writes benchmarks/results/startup.json and the "startup" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import free_port, machine, median, update_doc_section, write_json  # noqa: E402

from infer.demo import SERVE_SPEC_MAX_BATCH, real_model_path, real_model_speculation  # noqa: E402

PROMPT = "Explain in two sentences why the sky is blue."
LIMIT_S = 420  # a run that has not answered by then is recorded as failed
COMPILED_MARK = "compiled steps ready after"  # engine.warmup's last line: from then on at full speed


class Reader(threading.Thread):
    """Reads a process's stdout byte by byte; records when a line matching ``ready`` ends and when the first byte
    after the line matching ``before_reply`` arrives."""

    def __init__(self, proc, t0, ready: str, before_reply: str):
        super().__init__(daemon=True)
        self.proc, self.t0, self.ready_mark, self.reply_mark = proc, t0, ready, before_reply
        self.ready = self.first = None
        self.text = b""
        self.done = threading.Event()

    def run(self):
        line, armed = b"", False
        while (c := self.proc.stdout.read(1)):
            now = time.perf_counter() - self.t0
            self.text += c
            if armed and self.first is None and c.strip():
                self.first = now
                self.done.set()
            line += c
            if c == b"\n":
                s = line.decode(errors="replace")
                if self.ready is None and self.ready_mark in s:
                    self.ready = now
                if self.ready is not None and self.reply_mark in s:
                    armed = True
                line = b""
        self.done.set()


class ErrReader(threading.Thread):
    """Reads a process's stderr (infer's progress lines); records when the background compiling is done."""

    def __init__(self, proc, t0):
        super().__init__(daemon=True)
        self.proc, self.t0, self.lines, self.compiled = proc, t0, [], None
        self.done = threading.Event()

    def run(self):
        for raw in self.proc.stderr:
            line = raw.decode(errors="replace")
            self.lines.append(line)
            if self.compiled is None and COMPILED_MARK in line:
                self.compiled = time.perf_counter() - self.t0
                self.done.set()
        self.done.set()

    def tail(self) -> str:
        return "".join(self.lines)[-800:]


COMPILING_MARK = "infer: compiling"  # engine.warmup's stage lines: a warm-up is running
NO_WARMUP_GRACE_S = 5.0  # after the first token, how long a process that printed none of them is given to start one


def finish(proc, err: ErrReader, out: dict, wait_compiled: bool) -> dict:
    """Stop the process (once its compiled steps are ready, with ``wait_compiled``); add compiled_s or the error.
    A process that builds no graph (a lone request's steps are one C++ call each: `infer chat`, the demo, since
    2026-12-06) prints no compiling line: its full speed is its first token."""
    if wait_compiled and out["first_token_s"] is not None:
        time.sleep(NO_WARMUP_GRACE_S)
        if any(COMPILING_MARK in line for line in err.lines):
            err.done.wait(max(0.0, LIMIT_S - (time.perf_counter() - err.t0)))
        elif err.compiled is None:
            err.compiled = out["first_token_s"]
    proc.kill()
    proc.wait()
    err.join(5)
    out["compiled_s"] = err.compiled
    if out["first_token_s"] is None:
        out["error"] = out.pop("text", "") + err.tail()
    out.pop("text", None)
    return out


def run_cli(cmd: list[str], env: dict, ready: str, before_reply: str, stdin: bytes | None,
            wait_compiled: bool) -> dict:
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    reader, err = Reader(proc, t0, ready, before_reply), ErrReader(proc, t0)
    reader.start(), err.start()
    if stdin is not None:
        proc.stdin.write(stdin)
        proc.stdin.flush()
    reader.done.wait(LIMIT_S)
    out = {"ready_s": reader.ready, "first_token_s": reader.first, "text": reader.text.decode(errors="replace")[-800:]}
    return finish(proc, err, out, wait_compiled)


def run_serve(env: dict, wait_compiled: bool) -> dict:
    port = free_port()
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "infer", "serve", "--model", str(real_model_path()), "--port",
                             str(port), "--served-model-name", "m"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    err = ErrReader(proc, t0)
    err.start()
    base, out = f"http://127.0.0.1:{port}", {"ready_s": None, "first_token_s": None}
    try:
        while time.perf_counter() - t0 < LIMIT_S and proc.poll() is None:
            try:
                urllib.request.urlopen(base + "/health", timeout=1).read()
                out["ready_s"] = time.perf_counter() - t0
                break
            except OSError:
                time.sleep(0.05)
        if out["ready_s"] is not None:
            body = json.dumps({"model": "m", "messages": [{"role": "user", "content": PROMPT}], "stream": True,
                               "max_tokens": 16, "temperature": 0}).encode()
            req = urllib.request.Request(base + "/v1/chat/completions", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=LIMIT_S) as r:
                for raw in r:
                    line = raw.decode().strip()
                    if not line.startswith("data: {"):
                        continue
                    delta = json.loads(line[6:])["choices"][0].get("delta", {})
                    if delta.get("content"):
                        out["first_token_s"] = time.perf_counter() - t0
                        break
    finally:
        out = finish(proc, err, out, wait_compiled)
    return out


def commands(env: dict, wait_compiled: bool) -> dict:
    model = str(real_model_path())
    infer = [sys.executable, "-m", "infer"]
    return {
        "chat": lambda: run_cli(infer + ["chat", "--model", model, "--max-tokens", "16"], env, "infer chat with",
                                "infer chat with", (PROMPT + "\n").encode(), wait_compiled),
        "demo": lambda: run_cli(infer + ["demo", "--max-tokens", "16"], env, "[ready in", "> ", None, wait_compiled),
        "serve": lambda: run_serve(env, wait_compiled),
    }


FILL = """
from infer import LLM
from infer.demo import (CHAT_ENGINE, REAL_MODEL_SETTINGS, real_model_path, real_model_speculation,
                        with_real_model_defaults, with_serve_defaults)
path = real_model_path()
for kw in (dict(**CHAT_ENGINE, **with_real_model_defaults({"model": path})),  # infer chat --model <gguf>
           dict(model=path, **REAL_MODEL_SETTINGS, **CHAT_ENGINE, **real_model_speculation()),  # infer demo
           with_serve_defaults({"model": path})):  # infer serve --model <gguf>
    llm = LLM(**kw)
    llm.engine.wait_until_ready()
    llm.close()
"""


def fill(env: dict) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", FILL], env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--only", default="chat,demo,serve")
    ap.add_argument("--seed-warm", metavar="DIR", help="copy this infer cache (e.g. ~/.cache/infer) into the warm "
                    "directory before filling it: the fill then only adds what is missing")
    a = ap.parse_args()
    names = a.only.split(",")
    base_env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    root = Path(tempfile.mkdtemp(prefix="infer-startup-"))
    runs = {f"{kind} {name}": [] for kind in ("cold", "warm") for name in names}
    try:
        warm_env = {**base_env, "XDG_CACHE_HOME": str(root / "warm")}
        if a.seed_warm:
            shutil.copytree(Path(a.seed_warm).expanduser(), root / "warm" / "infer")
        fill_s = fill(warm_env)
        print(f"filled the warm caches in {fill_s:.0f}s", flush=True)
        for i in range(a.runs):  # cold and warm alternate: a slower stretch of the machine hits both
            for name in names:
                cold_dir = root / f"cold-{i}-{name}"
                for kind, env in (("cold", {**base_env, "XDG_CACHE_HOME": str(cold_dir)}), ("warm", warm_env)):
                    try:
                        r = commands(env, wait_compiled=kind == "warm")[name]()
                    except Exception as e:  # recorded, not fatal: the other cells still run
                        r = {"ready_s": None, "first_token_s": None, "compiled_s": None,
                             "error": f"{type(e).__name__}: {e}"}
                    shutil.rmtree(cold_dir, ignore_errors=True)
                    runs[f"{kind} {name}"].append(r)
                    print(f"{kind} {name} #{i + 1}: {r}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    def stats(xs):
        xs = [x for x in xs if x is not None]
        return {"median": median(xs), "min": min(xs), "max": max(xs), "n": len(xs)} if xs else None

    summary = {cell: {m: stats([r.get(m) for r in rs]) for m in ("ready_s", "first_token_s", "compiled_s")}
               for cell, rs in runs.items()}
    res = {"machine": machine(), "model": real_model_path().name, "speculation": {
        "chat/demo": {k: Path(v).name if k == "draft_model" else v for k, v in real_model_speculation().items()},
        "serve": f"the same, rounds while at most {SERVE_SPEC_MAX_BATCH} requests decode (its default)"},
        "prompt": PROMPT, "fill_s": fill_s, "runs": runs, "summary": summary}
    write_json("startup", res)

    def cell(s):
        return "failed" if s is None else f"{s['median']:.1f} s ({s['min']:.1f}-{s['max']:.1f})"

    m = res["machine"]
    md = [f"Process start to ready and to the first streamed token, SmolLM2-135M-Instruct ({res['model']}), each "
          f"command's default speculation (chat/demo: {res['speculation']['chat/demo']}; serve: "
          f"{res['speculation']['serve']}). {m['cpu']}, "
          f"{m['cores']} cores, torch {m['torch']}, {m['date']}. Cold: empty `XDG_CACHE_HOME` per run; warm: caches "
          f"filled once ({fill_s:.0f} s of compiling and profiling). Median of {a.runs} runs (min-max). "
          "`python benchmarks/startup.py`.", "",
          "| command | cold: ready | cold: first token | warm: ready | warm: first token | warm: full speed |",
          "|---|---|---|---|---|---|"]
    for name in names:
        c, w = summary[f"cold {name}"], summary[f"warm {name}"]
        md.append(f"| `infer {name}` | {cell(c['ready_s'])} | {cell(c['first_token_s'])} | {cell(w['ready_s'])} | "
                  f"{cell(w['first_token_s'])} | {cell(w['compiled_s'])} |")
    md += ["", "Full speed: the process's stderr says its compiled steps are all built (engine.warmup); until then "
           "steps without a graph run eagerly, with the same tokens. `infer demo` exits after its replies, "
           "sometimes before that line."]
    update_doc_section("startup", "\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()

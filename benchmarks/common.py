"""Shared benchmark plumbing: machine facts, interleaved A/B timing, results files, docs table sections."""

from __future__ import annotations

import json
import os
import platform
import re
import socket
import statistics
import subprocess
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "benchmarks.md"


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    # a cloud host may name itself only "AMD EPYC": its family and model tell Zen 4 (25/17) from Zen 5 (26/2), and the
    # vector ISA is what the kernels' figures depend on, so both go with every figure
    info: dict[str, str] = {}
    try:
        for line in open("/proc/cpuinfo"):
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
            if key.strip() == "flags":
                break
    except OSError:
        pass
    cpu = info.get("model name", cpu)
    if "cpu family" in info:  # x86 (an ARM cpuinfo names neither a family nor these flags)
        flags = set(info.get("flags", "").split())
        isa = ("AVX-512 VNNI" if "avx512_vnni" in flags else "AVX-512" if "avx512f" in flags
               else "AVX2" if "avx2" in flags else None)
        if isa and "amx_tile" in flags:
            isa += ", AMX"
        cpu += f" (family {info['cpu family']} model {info.get('model', '?')}" + (f", {isa})" if isa else ")")
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(),
            "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "date": time.strftime("%Y-%m-%d"), "revision": revision(), "l3_cache": l3_cache()}


def l3_cache() -> str | None:
    """The last-level cache a core sees (sysfs), e.g. "32768K": whether the model's ~95 MB stay in cache changes
    which term a figure is bound by (one Xeon model's plain decoding read 2-3x apart on hosts with
    480 MB and less)."""
    try:
        return Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
    except OSError:
        return None


def git(*args: str) -> str:
    """``git args`` in the checkout, its stdout stripped; "" where git is missing or fails (no checkout)."""
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except OSError:  # no git on this machine
        return ""


def revision() -> str:
    """The checkout's commit, "+dirty" when the code differs from it (src/, benchmarks/ less its results: docs and
    figures written meanwhile are not the build): the build a figure was measured on; "unknown" outside a checkout."""
    head = git("rev-parse", "--short", "HEAD")
    if not head:
        return "unknown"
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", "src", "benchmarks", ":!benchmarks/results")
    return head + ("+dirty" if dirty else "")


# host_probe's 2-thread over 1-thread rate at or above which the host reads quiet: 1.90-1.93 in quiet phases; 1.78-1.86
# where something else shares the cores a little (the defaults read 1.42x greedy there against 1.63x quiet, ten
# minutes apart, 2026-12-05), ~1.0 where the second core is taken
QUIET_SCALING = 1.88


def host_probe(bursts: int = 3, mms: int = 20) -> dict:
    """What the 2 cores give right now (~30 ms): a float32 product held in L2 (256 x 256) timed on 1 thread and on
    2 (the best of ``bursts`` bursts of ``mms`` products each). Why: the shared Zen 4 host's cores come and go in
    phases of tens of seconds, and the speculating engine's rounds feel it where plain decoding, which streams its
    weights from memory, barely does. This probe read 1.90-1.93x (2 threads over 1, ~102 GFLOP/s on 1) quiet and
    1.78-1.86x contended; a longer probe read 0.86-1.05x, the 1-thread rate ~77, where the second core was taken
    (2026-12-05; docs/benchmarks.md, "the host's state beside each run").
    -> {"gflops_1": ..., "gflops_2": ..., "scaling": gflops_2 / gflops_1}."""
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    threads = torch.get_num_threads()
    rates = {}
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            best = float("inf")
            for _ in range(bursts):
                t0 = time.perf_counter()
                for _ in range(mms):
                    torch.mm(a, b)
                best = min(best, time.perf_counter() - t0)
            rates[n] = mms * 2 * 256 ** 3 / best / 1e9
    finally:
        torch.set_num_threads(threads)
    return {"gflops_1": rates[1], "gflops_2": rates[2], "scaling": rates[2] / rates[1]}


def by_host_state(runs: dict, name: str, base: str = "ours AR") -> dict:
    """``name``'s decode speed over ``base``'s by the host's state, from drafters.py's stored runs of one temperature
    ({variant: per prompt, per round [t, decode s, decode tokens, probe scaling, probe GFLOP/s on 1 thread]}): over
    the (round, prompt) pairs both of whose probes read quiet (>= QUIET_SCALING), and both contended (pairs with one
    of each are in neither). A reading mixes the states in whatever shares its hour had; this says what each gives.
    -> {state: {"pairs": n, "decode_speedup": x}} for the states that have pairs."""
    out = {}
    for state in ("quiet", "contended"):
        pairs = [(s, p) for ss, ps in zip(runs[name], runs[base]) for s, p in zip(ss, ps)
                 if (s[3] >= QUIET_SCALING) == (p[3] >= QUIET_SCALING) == (state == "quiet")]
        if pairs:
            rate = lambda rs: sum(r[2] for r in rs) / sum(r[1] for r in rs)  # noqa: E731
            out[state] = {"pairs": len(pairs),
                          "decode_speedup": rate([s for s, _ in pairs]) / rate([p for _, p in pairs])}
    return out


def interleaved(fns: dict[str, callable], repeats: int) -> dict[str, list[float]]:
    """Run every variant once per round, rounds repeated (A B C A B C ...); returns seconds per variant."""
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - t0)
    return times


def paired_passes(plain, spec, ids: list, variants: list[str], setup, passes: int, temperature: float,
                  new_tokens: int, on_pass=None) -> tuple[dict, dict]:
    """Each prompt (token ids) through plain decoding (the LLM ``plain``) and through every variant of one speculating
    LLM ``spec`` (``setup(name)`` switches it: the same compiled graphs for every variant), the order rotating by pass
    and prompt; the first pass a warm-up. -> (runs, counts): runs[name][(pass, prompt)] = (seconds after the first
    token, tokens after it, token ids), name "plain" or a variant; counts[variant] = [accepted drafts, drafts
    verified, rounds]. ``on_pass(pass, runs)`` after each recorded pass (progress)."""
    from infer import SamplingParams

    stats = spec.engine.runner.stats
    names = ["plain", *variants]
    runs = {n: {} for n in names}
    counts = {n: [0, 0, 0] for n in variants}
    for rep in range(passes + 1):
        for i, x in enumerate(ids):
            shift = (rep + i) % len(names)
            for n in names[shift:] + names[:shift]:
                if n != "plain":
                    setup(n)
                before = (stats.num_accepted_tokens, stats.num_draft_tokens, stats.num_drafts)
                o = (plain if n == "plain" else spec).generate(
                    [x], SamplingParams(temperature=temperature, max_tokens=new_tokens, seed=rep))[0]
                if not rep:
                    continue
                runs[n][(rep, i)] = (o.metrics["finish_time"] - o.metrics["first_token_time"], len(o.token_ids) - 1,
                                     o.token_ids)
                if n != "plain":
                    after = (stats.num_accepted_tokens, stats.num_draft_tokens, stats.num_drafts)
                    counts[n] = [c + b - a for c, a, b in zip(counts[n], before, after)]
        if rep and on_pass is not None:
            on_pass(rep, runs)
    return runs, counts


def defaults_beside_plain(per_kind: int) -> tuple[list[tuple[str, str]], object, object]:
    """The first ``per_kind`` chat and code held-out prompts as (kind, text), a plain engine and one running SmolLM2's
    default speculation (as ``infer chat``: bfloat16 over its Q4_1 blocks, compiled, one request), both ready: what
    ``paired_passes`` takes."""
    from infer import LLM
    from infer.demo import REAL_MODEL_SETTINGS, real_model_path, real_model_speculation
    from infer.drafters import eval_prompts

    settings = {**REAL_MODEL_SETTINGS, "compile_in_background": False}
    held = eval_prompts()
    prompts = [(kind, p["prompt"]) for kind in ("chat", "code") for p in held[kind][:per_kind]]
    plain = LLM(real_model_path(), max_batch_size=1, **settings)
    spec = LLM(real_model_path(), max_batch_size=1, **settings, **real_model_speculation())
    plain.engine.wait_until_ready()
    spec.engine.wait_until_ready()
    return prompts, plain, spec


def over_plain(runs: dict, name: str, rep: int) -> float:
    """``paired_passes``' runs: pass ``rep``'s decode speed of ``name`` over plain decoding's, each side's seconds and
    tokens summed over the pass's prompts."""
    secs = lambda m: sum(v[0] for (r, _), v in runs[m].items() if r == rep)  # noqa: E731
    toks = lambda m: sum(v[1] for (r, _), v in runs[m].items() if r == rep)  # noqa: E731
    return secs("plain") / toks("plain") / (secs(name) / toks(name))


def pass_over_plain(runs: dict, name: str, rep: int) -> float:
    """``paired_passes``' runs: the median over pass ``rep``'s prompts of plain decoding's time a token over ``name``'s
    (its decode speed over plain's)."""
    return statistics.median(runs["plain"][key][0] / max(runs["plain"][key][1], 1) / (v[0] / max(v[1], 1))
                             for key, v in runs[name].items() if key[0] == rep)


def ratio_quartiles(runs: dict, prompts: list[tuple[str, str]]):
    """``paired_passes``' runs -> over(n, base, kind=None): quartiles of ``base``'s time a token over ``n``'s on the
    same (pass, prompt), over every prompt or those of one kind."""
    per_tok = {n: {key: s / max(t, 1) for key, (s, t, _) in r.items()} for n, r in runs.items()}

    def over(n: str, base: str, kind: str | None = None) -> dict:
        return quartiles([per_tok[base][key] / t for key, t in per_tok[n].items()
                          if kind is None or prompts[key[1]][0] == kind])
    return over


def free_port() -> int:
    """A TCP port free on loopback now (for a server a benchmark starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def median(xs):
    return statistics.median(xs)


def quartiles(xs: list[float]) -> dict:
    """The median and quartiles of a side's figures (a shared machine: the spread says how far to trust a ratio)."""
    q = statistics.quantiles(xs, n=4)
    return {"median": statistics.median(xs), "q1": q[0], "q3": q[2], "n": len(xs)}


def spread(q: dict) -> str:
    """A ``quartiles`` dict as "median (q1-q3)" for a table cell."""
    return f"{q['median']:.1f} ({q['q1']:.1f}-{q['q3']:.1f})"


def write_json(name: str, data: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def results_of(name: str, render_only: bool, run) -> dict:
    """``--render``: the stored results/<name>.json; else ``run()``'s results, stored there."""
    if render_only:
        return json.loads((RESULTS / f"{name}.json").read_text())
    res = run()
    write_json(name, res)
    return res


def update_doc_section(section: str, markdown: str) -> None:
    """Replace (or append) the block between <!-- BEGIN section --> and <!-- END section --> in docs/benchmarks.md."""
    DOC.parent.mkdir(parents=True, exist_ok=True)
    text = DOC.read_text() if DOC.exists() else "# Benchmarks\n"
    begin, end = f"<!-- BEGIN {section} -->", f"<!-- END {section} -->"
    block = f"{begin}\n{markdown.rstrip()}\n{end}"
    if begin in text:
        text = re.sub(re.escape(begin) + r".*?" + re.escape(end), lambda _: block, text, flags=re.S)
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    DOC.write_text(text)

"""Several rows' products with their groups in chunks off a counter against one fixed half per thread (issue 33's v on
a shared host).

    python benchmarks/qlinear_dynamic.py [--prompts 24] [--passes 2] [--render]

SmolLM2's defaults (bfloat16 over its Q4_1 blocks, compiled, one request) on the held-out prompts, greedy and at 0.7:
per prompt the speculating engine runs once with infer::qlinear_dynamic on and once off, the order alternating, each
run after common.host_probe. A verify's products (several rows) are the calls the switch changes; a plain decode
step's one row keeps its halves either way, and the outputs are the same bits (tests/test_qlinear.py). Per
temperature: decode time off over on (> 1: the chunks faster), over all pairs and over the pairs whose two probes read
quiet and both contended (common.QUIET_SCALING): the chunks can only gain where the cores run at unequal speeds.
Writes benchmarks/results/qlinear_dynamic.json and the "qlinear-dynamic" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (QUIET_SCALING, defaults_beside_plain, host_probe, machine, results_of,  # noqa: E402
                    update_doc_section)

from infer import SamplingParams  # noqa: E402

NAME = "qlinear_dynamic"


def measure(a) -> dict:
    prompts, _, spec = defaults_beside_plain(a.prompts)
    ids = [spec.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for _, p in prompts]
    out = {"machine": machine(), "prompts": len(ids), "passes": a.passes, "quiet_scaling": QUIET_SCALING}
    for temp in (0.0, 0.7):
        params = SamplingParams(temperature=temp, max_tokens=128, seed=0)
        pairs = []
        for rep in range(a.passes + 1):  # pass 0 warms up
            for i, x in enumerate(ids):
                run = {}
                for on in ((True, False) if (rep + i) % 2 == 0 else (False, True)):
                    torch.ops.infer.qlinear_dynamic(on)
                    probe = host_probe()
                    getattr(spec.engine.decoder.proposer, "clear", lambda: None)()
                    torch.manual_seed(1000 * rep + i)
                    o = spec.generate([x], params)[0]
                    m = o.metrics
                    run[on] = (m["finish_time"] - m["first_token_time"], len(o.token_ids) - 1, probe["scaling"])
                if rep:
                    pairs.append({"prompt": i, "on": run[True], "off": run[False]})
        torch.ops.infer.qlinear_dynamic(False)  # the build's default
        out[str(temp)] = pairs
    return out


def summary(pairs: list) -> dict:
    def ratio(ps):  # decode tok/s on over off, pooled
        if not ps:
            return None
        rate = lambda side: sum(p[side][1] for p in ps) / sum(p[side][0] for p in ps)  # noqa: E731
        return {"pairs": len(ps), "on_over_off": rate("on") / rate("off")}
    q = lambda p: p["on"][2] >= QUIET_SCALING and p["off"][2] >= QUIET_SCALING  # noqa: E731
    c = lambda p: p["on"][2] < QUIET_SCALING and p["off"][2] < QUIET_SCALING  # noqa: E731
    return {"all": ratio(pairs), "quiet": ratio([p for p in pairs if q(p)]),
            "contended": ratio([p for p in pairs if c(p)])}


def render(res: dict) -> None:
    f = lambda s: "-" if s is None else f"{s['on_over_off']:.3f} ({s['pairs']})"  # noqa: E731
    lines = [f"`python benchmarks/qlinear_dynamic.py` ({res['machine']['cpu']}, {res['machine']['cores']} cores, "
             f"{res['machine']['date']}, build {res['machine'].get('revision')}). SmolLM2's defaults, "
             f"{res['prompts']} held-out prompts x 128 tokens, {res['passes']} passes; per prompt the speculating "
             "engine with several rows' groups in chunks off a counter (on) and in fixed halves (off), order "
             "alternating, common.host_probe before each run. Decode speed on over off (pairs): all pairs, both "
             f"probes quiet (>= {res['quiet_scaling']}), both contended.", "",
             "| temperature | all | quiet | contended |", "|---|---|---|---|"]
    for t in ("0.0", "0.7"):
        s = summary(res[t])
        lines.append(f"| {t} | {f(s['all'])} | {f(s['quiet'])} | {f(s['contended'])} |")
    update_doc_section("qlinear-dynamic", "\n".join(lines))
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=24, help="per kind (chat, code)")
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--render", action="store_true")
    a = ap.parse_args()
    t0 = time.perf_counter()
    res = results_of(NAME, a.render, lambda: measure(a))
    render(res)
    print(f"{time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()

"""What entering a compiled graph costs, cold and warm: torch.compile (Dynamo) against AOTInductor (issue 33).

A speculative round makes two compiled calls where plain decoding makes one (the draft round's and the verify's), and
each starts cold: the target's ~96 MB of weights have just streamed through the caches, so the host code and data
every call walks (Python frames, Dynamo's guards and wrappers, the graph's C++ wrapper) come back from memory.
This measures that entry alone, on the same kernels: the shipped EAGLE-3 head's last ops (its MLP and residual, its
norm, its 8,192-row head over the draft vocabulary, the argmax; infer's kernels over its Q8_0 blocks, ~7 MB) called

- eager: the module's own code, op by op (infer's kernels, ATen's elementwise ops);
- compiled, hook: ``torch.compile`` as ``model.compile`` builds a step (the engine's CPU options: inductor, C++
  wrapper; guards on the module's state filtered out; weights installed in the graph), entered through Dynamo's
  frame hook: its frame evaluation, its guards, the compiled region's entry, then the graph's code (its inputs
  gathered, the AOT runtime wrapper, the C++ wrapper);
- compiled, direct: the same graph entered as the engine enters it (``model.compile``'s
  ``_GraphEntry``: Dynamo's cache entries looked up here, their guards checked, the graph's code run);
- aoti: the same graph exported (``torch.export``) and built ahead of time (``aoti_compile_and_package``), called
  through its Python wrapper (``AOTICompiledModel``: the inputs flattened by pytree);
- aoti run: the same package's ``loader.run`` (a list of tensors straight into the C++ runner).

"cold": right after streaming 96 MB (a SmolLM2 step's weights); "warm": the same call repeated at once. The five
paths in shuffled order each repeat; medians and quartiles in microseconds. The answers are checked equal first.
Writes benchmarks/results/call_entry.json and the "call-entry" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch

from common import machine, quartiles, results_of, update_doc_section
from infer.drafters import drafter_paths
import infer.model.compile as compile_module
from infer.model.compile import _compile_method, cpu_options, step_guards

STREAM_MB = 96  # SmolLM2-135M's Q4_1 body and Q8_0 head: what a decode or verify step reads


class HeadTail(torch.nn.Module):
    """An EAGLE-3 draft step's last ops: h + mlp(norm(h)), the final norm, the draft-vocabulary head, the argmax."""

    def __init__(self, head):
        super().__init__()
        self.post_norm, self.mlp = head.layer.post_attention_layernorm, head.layer.mlp
        self.norm, self.lm_head = head.norm, head.lm_head

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # [1, H] bfloat16 -> [1] int64
        h = h + self.mlp(self.post_norm(h))
        return self.lm_head(self.norm(h)).float().argmax(-1)

    @property
    def device(self) -> torch.device:  # what model.compile asks of a model
        return self.norm.weight.device


def load_head():
    from infer import LLM
    from infer.demo import REAL_MODEL_SETTINGS, real_model_path

    llm = LLM(str(real_model_path()), **REAL_MODEL_SETTINGS, draft_model=str(drafter_paths()["eagle3"]),
              proposer="draft", max_batch_size=1, compile=False)
    return llm.engine.decoder.proposer.head


def run(repeats: int) -> dict:
    torch.set_num_threads(min(2, torch.get_num_threads()))
    tail = HeadTail(load_head()).eval()
    h = torch.randn(1, tail.norm.weight.shape[0]).to(torch.bfloat16)
    with torch.inference_mode():
        # as model.compile builds a step: the engine's options, guards on the module's own state filtered out, the
        # weights installed in the graph (not fetched as inputs before each call)
        compiled, _ = _compile_method(tail, "forward", {**cpu_options(), "guard_filter_fn": step_guards})
        t0 = time.perf_counter()
        program = torch.export.export(tail, (h,))
        package = Path(tempfile.mkdtemp()) / "tail.pt2"
        aoti = torch._inductor.aoti_load_package(torch._inductor.aoti_compile_and_package(
            program, package_path=str(package), inductor_configs={"cpp.min_chunk_size": 16384}))
        build_s = time.perf_counter() - t0

        def hooked():
            compile_module.DIRECT_ENTRY = False
            try:
                return compiled(h)
            finally:
                compile_module.DIRECT_ENTRY = True

        paths = {"eager": lambda: tail(h), "compiled, hook": hooked, "compiled, direct": lambda: compiled(h),
                 "aoti": lambda: aoti(h),
                 "aoti run": lambda: aoti.loader.run([h])[0]}
        want = tail(h)
        for name, fn in paths.items():
            for _ in range(3):
                got = fn()
            assert torch.equal(got, want), f"{name}: {got} != {want}"
        stream = torch.ones(STREAM_MB << 18)  # float32
        times = {(name, side): [] for name in paths for side in ("cold", "warm")}
        for _ in range(repeats):
            order = list(paths)
            random.shuffle(order)
            for name in order:
                stream.sum()
                for side in ("cold", "warm"):
                    t = time.perf_counter()
                    paths[name]()
                    times[(name, side)].append(1e6 * (time.perf_counter() - t))
    return {"repeats": repeats, "aoti_build_s": round(build_s, 1),
            "us": {f"{name} {side}": {k: round(x, 1) for k, x in quartiles(v).items()}
                   for (name, side), v in times.items()}}


def render(res: dict, info: dict) -> str:
    us = res["us"]
    rows = ["| call | cold (us) | warm (us) | cold - warm |", "|---|---|---|---|"]
    for name in ("eager", "compiled, hook", "compiled, direct", "aoti", "aoti run"):
        c, w = us[f"{name} cold"], us[f"{name} warm"]
        rows.append(f"| {name} | {c['median']:.0f} ({c['q1']:.0f}-{c['q3']:.0f}) | {w['median']:.0f} "
                    f"({w['q1']:.0f}-{w['q3']:.0f}) | {c['median'] - w['median']:.0f} |")
    return (f"`python benchmarks/call_entry.py` ({info['cpu']}, {info['torch_threads']} threads, torch "
            f"{info['torch']}, {info['date']}). The shipped EAGLE-3 head's MLP, norm, 8,192-row head and argmax "
            f"(Q8_0, infer's kernels) on one bfloat16 row, entered five ways; cold = right after streaming "
            f"{STREAM_MB} MB, warm = repeated at once; {res['repeats']} shuffled repeats, median (quartiles). The "
            f"ahead-of-time build took {res['aoti_build_s']} s.\n\n" + "\n".join(rows) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=60)
    ap.add_argument("--render", action="store_true", help="re-render the stored results, measure nothing")
    args = ap.parse_args()
    info = machine()
    stored = results_of("call_entry", args.render, lambda: {"machine": info, "results": run(args.repeats)})
    update_doc_section("call-entry", "## Entering a compiled graph, cold and warm (issue 33)\n\n"
                       + render(stored["results"], stored["machine"]))


if __name__ == "__main__":
    main()

"""Single-sequence decode speed: infer vs Hugging Face transformers `generate`, same checkpoint, same process.

A random-weight ~26M-parameter Llama (Llama-3.2-like: GQA, tied embeddings, llama3 RoPE), float32, greedy,
one prompt, fixed number of new tokens (EOS ignored). Variants run interleaved (ours, HF, ours, HF, ...);
we report medians and the ratio. Writes benchmarks/results/decode_speed.json and a table in docs/benchmarks.md.

    python benchmarks/decode_speed.py [--new-tokens 128] [--repeats 7]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import interleaved, machine, median, update_doc_section, write_json  # noqa: E402

from infer import LLM, SamplingParams  # noqa: E402
from infer.testing import make_tiny_llama, param_count  # noqa: E402

SHAPE = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=7, num_attention_heads=8,
             num_key_value_heads=4, head_dim=64)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from transformers import LlamaForCausalLM as HFLlama

    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_llama(tmp, "llama3", vocab_size=8192, max_position_embeddings=1024, **SHAPE)
        n_params = param_count(path)
        llm = LLM(path, dtype="float32", compile_in_background=False)  # timed: graphs first
        hf = HFLlama.from_pretrained(path, dtype=torch.float32).eval()
        prompt = torch.randint(0, 300, (a.prompt_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
        params = SamplingParams(temperature=0, max_tokens=a.new_tokens, ignore_eos=True)
        ids = torch.tensor([prompt])

        def ours():
            return llm.generate([prompt], params)[0].token_ids

        def theirs():
            with torch.inference_mode():
                return hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                   max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens,
                                   pad_token_id=0)[0, len(prompt):].tolist()

        same = ours() == theirs()  # warm-up, and the outputs must agree
        times = interleaved({"infer": ours, "transformers": theirs}, a.repeats)
    med = {k: median(v) for k, v in times.items()}
    tps = {k: a.new_tokens / v for k, v in med.items()}
    result = {
        "benchmark": "decode_speed", "machine": machine(), "params": n_params, "dtype": "float32",
        "shape": SHAPE, "vocab_size": 8192, "prompt_tokens": a.prompt_tokens, "new_tokens": a.new_tokens,
        "repeats": a.repeats, "greedy_outputs_identical": same, "seconds": times, "median_seconds": med,
        "tokens_per_s": tps, "speedup_vs_transformers": tps["infer"] / tps["transformers"],
    }
    write_json("decode_speed", result)
    m = result["machine"]
    table = (
        "## Single-sequence decode speed (issue 2)\n\n"
        f"Random-weight Llama, {n_params / 1e6:.1f}M parameters (hidden 512, 7 layers, GQA 8/4, tied, llama3 RoPE, "
        f"vocab 8192), float32, greedy, {a.prompt_tokens}-token prompt, {a.new_tokens} new tokens (EOS ignored), "
        f"{a.repeats} interleaved repeats, median. {m['cpu']}, {m['torch_threads']} threads, torch {m['torch']}, "
        f"{m['date']}. Outputs identical: {same}.\n\n"
        "| engine | tokens/s | vs transformers |\n|---|---:|---:|\n"
        f"| infer `LLM.generate` | {tps['infer']:.1f} | {result['speedup_vs_transformers']:.2f}x |\n"
        f"| transformers `generate` | {tps['transformers']:.1f} | 1.00x |\n\n"
        "Reproduce: `python benchmarks/decode_speed.py`."
    )
    update_doc_section("decode_speed", table)
    print(table)


if __name__ == "__main__":
    main()

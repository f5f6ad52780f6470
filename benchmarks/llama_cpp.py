"""llama.cpp as a peer in the benchmarks: its tools run on the same GGUF files, prompts and machine, in the same run.

llama.cpp is never built or installed by infer (nor by its tests); a benchmark that is given the directory of its
binaries runs them. To build the tools used here (~20 min on 2 cores), from the llama-cpp-python sdist:

    pip download --no-deps --no-binary :all: llama-cpp-python && tar xzf llama_cpp_python-*.tar.gz
    cd llama_cpp_python-*/vendor/llama.cpp
    cmake -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF
    cmake --build build -j 2 --target llama-bench llama-speculative-simple llama-lookup llama-completion

and pass ``--llama-dir .../build/bin``. A drafter shipped as a Hugging Face checkpoint (smollm2-lm) is converted to a
GGUF by llama.cpp's own ``convert_hf_to_gguf.py`` (``--llama-src``, the llama.cpp source tree), once, into a cache.

Timings are llama.cpp's own (its tools print the seconds of the prompt's encoding and of the decoding), so a
process's start and model load are not counted, as they are not for infer.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Run:
    """One generation: tokens decoded, seconds encoding the prompt and decoding, drafts made and accepted."""

    tokens: int
    encode_s: float
    decode_s: float
    drafted: int | None = None
    accepted: int | None = None


def _parse(out: str) -> Run:
    enc = re.search(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds", out)
    dec = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) (?:seconds|s)", out)
    if dec is None:  # llama-completion: its perf lines, in ms (decode: the evals after the prompt's)
        pe = re.search(r"prompt eval time =\s+([\d.]+) ms", out)
        ev = re.search(r"(?<!prompt )eval time =\s+([\d.]+) ms /\s+(\d+) runs", out)
        if ev is None:
            raise RuntimeError(f"llama.cpp printed no timing:\n{out[-2000:]}")
        return Run(int(ev.group(2)), float(pe.group(1)) / 1e3 if pe else 0.0, float(ev.group(1)) / 1e3)
    drafted = re.search(r"n_drafted\s*=\s*(\d+)", out)
    accepted = re.search(r"n_accept\s*=\s*(\d+)", out)
    return Run(int(dec.group(1)), float(enc.group(2)) if enc else 0.0, float(dec.group(2)),
               int(drafted.group(1)) if drafted else None, int(accepted.group(1)) if accepted else None)


def _run(cmd: list[str]) -> Run:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:3])} ... failed ({out.returncode}):\n{out.stderr[-2000:]}")
    return _parse(out.stderr + out.stdout)


def common_args(prompt: str, n: int, temp: float, threads: int, seed: int = 0) -> list[str]:
    return ["-p", prompt, "-n", str(n), "-t", str(threads), "--temp", str(temp), "-s", str(seed), "-c", "4096"]


def speculative(bin_dir: Path, target: Path, draft: Path, prompt: str, n: int, temp: float, k: int,
                threads: int) -> Run:
    """llama-speculative-simple: the target verifies up to ``k`` drafts of the draft model per step (--spec-type
    draft-simple: this llama.cpp infers the kind from a draft GGUF's metadata and finds none in a plain Llama)."""
    return _run([str(bin_dir / "llama-speculative-simple"), "-m", str(target), "-md", str(draft),
                 "--spec-type", "draft-simple", "--spec-draft-n-max", str(k), "-td", str(threads), *common_args(prompt, n, temp, threads)])


def lookup(bin_dir: Path, target: Path, prompt: str, n: int, temp: float, k: int, threads: int) -> Run:
    """llama-lookup: n-gram drafts from the prompt and the text so far (prompt lookup)."""
    return _run([str(bin_dir / "llama-lookup"), "-m", str(target), "--spec-draft-n-max", str(k),
                 *common_args(prompt, n, temp, threads)])


def plain(bin_dir: Path, target: Path, prompt: str, n: int, threads: int) -> Run:
    """llama-completion: greedy decoding, no speculation, the prompt as raw text (-no-cnv). Not llama-simple: it
    takes no thread count (a "-t 2" became part of its prompt) and ran llama.cpp's default 4 threads on 2 cores,
    ~5x slower than llama-bench (the drafters runs of 2026-11-26)."""
    return _run([str(bin_dir / "llama-completion"), "-no-cnv", "-m", str(target), *common_args(prompt, n, 0.0, threads)])


def bench_tg(bin_dir: Path, model: Path, n: int, threads: int) -> float:
    """llama-bench's token generation (tg, -p 0): decode tokens/s, the average of its repetitions."""
    out = subprocess.run([str(bin_dir / "llama-bench"), "-m", str(model), "-p", "0", "-n", str(n), "-t", str(threads),
                          "-o", "json"], capture_output=True, text=True, timeout=900, check=True)
    return float(json.loads(out.stdout)[0]["avg_ts"])


def build_commit(bin_dir: Path, model: Path) -> str | None:
    try:
        out = subprocess.run([str(bin_dir / "llama-bench"), "-m", str(model), "-p", "0", "-n", "1", "-r", "1",
                              "-o", "json"], capture_output=True, text=True, timeout=300, check=True)
        rec = json.loads(out.stdout)[0]
        return f"{rec.get('build_commit')} ({rec.get('build_number')})"
    except (subprocess.SubprocessError, OSError, ValueError, IndexError):
        return None


def convert_hf(llama_src: Path, hf_dir: Path, out: Path, outtype: str = "bf16") -> Path:
    """An HF checkpoint as a GGUF (llama.cpp's convert_hf_to_gguf.py, its own gguf-py), once."""
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    env_path = str(llama_src / "gguf-py")
    subprocess.run([sys.executable, str(llama_src / "convert_hf_to_gguf.py"), str(hf_dir), "--outfile", str(out),
                    "--outtype", outtype], check=True, env={**__import__("os").environ, "PYTHONPATH": env_path})
    return out

"""``infer chat``: an interactive, streaming terminal chat with a model's own chat template.

Each line you type is a user turn; the reply streams as the engine produces it. ``/reset`` forgets the
conversation, ``/exit`` (or end of input) quits. With a drafter, every reply ends with its speculation figures.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from . import progress

HELP = "commands: /reset (forget the conversation), /help, /exit (or Ctrl-D)"


def stream_reply(llm, messages: list[dict], params, out=None) -> tuple[str, dict]:
    """Stream the assistant's reply to ``messages`` onto ``out`` (default: sys.stdout as it is at the call, not at
    import: a caller may have redirected it since); return its text and figures."""
    out = out or sys.stdout
    ids = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    warming = _warming(llm)
    t0 = time.perf_counter()
    first = None
    parts, n, last = [], 0, None
    for o in llm.stream(ids, params):
        if first is None:
            first = time.perf_counter() - t0
        n += o.token_id is not None
        parts.append(o.text)
        out.write(o.text)
        out.flush()
        last = o
    dt = time.perf_counter() - t0
    stats = {"tokens": n, "seconds": dt, "tok_s": n / dt if dt > 0 else 0.0, "ttft_s": first,
             "finish_reason": last.finish_reason if last else None, "warming_up": warming}
    if last is not None and last.acceptance_rate is not None:
        stats.update(acceptance_rate=last.acceptance_rate, num_draft_tokens=last.num_draft_tokens,
                     num_accepted_tokens=last.num_accepted_tokens)
    return "".join(parts), stats


def _warming(llm) -> bool:
    """Whether the engine's compiled steps are still being built in the background (engine.warmup): its steps run
    eagerly or partly compiled meanwhile (a lone request's one-call steps excepted), and share the cores with the
    compiler, so a reply's tok/s is not the engine's speed."""
    warmup = getattr(getattr(llm, "engine", None), "warmup", None)
    return warmup is not None and not warmup.ready


def format_stats(s: dict) -> str:
    line = f"[{s['tokens']} tokens, {s['tok_s']:.1f} tok/s"
    if s.get("warming_up"):  # the figure a person reads first must not pass for the engine's speed
        line += " (still warming up: the compiled steps are being built)"
    line += f", first token {s['ttft_s'] or 0:.2f}s"
    if "acceptance_rate" in s:
        line += (f"; speculation: {s['num_accepted_tokens']}/{s['num_draft_tokens']} drafts accepted "
                 f"({s['acceptance_rate']:.0%})")
    return line + "]"


def run_chat(llm, params, system: str | None = None, inp=None, out=None) -> int:
    inp, out = inp or sys.stdin, out or sys.stdout  # the streams of the moment (stream_reply says why)
    if not llm.tokenizer.has_chat_template:
        raise ValueError(f"{llm.model_path}: the tokenizer has no chat template; use `infer generate` instead")
    base = [{"role": "system", "content": system}] if system else []
    messages = list(base)
    interactive = inp.isatty()
    name = llm.describe() if hasattr(llm, "describe") else Path(str(llm.model_path)).name  # a stand-in: its path
    print(f"infer chat with {name} ({HELP})", file=out)
    while True:
        if interactive:
            out.write("\n> ")
            out.flush()
        with progress.held():  # the warm-up's lines wait while a person types (then print after their line)
            line = inp.readline()
        if not line:  # end of input
            return 0
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return 0
        if text == "/help":
            print(f"[{HELP}]", file=out)
            continue
        if text == "/reset":
            messages = list(base)
            print("[conversation reset]", file=out)
            continue
        if text.startswith("/"):
            print(f"[unknown command {text.split()[0]!r}; {HELP}]", file=out)
            continue
        messages.append({"role": "user", "content": text})
        with progress.held():  # ... and while the reply streams: after its figures, on lines of their own
            reply, stats = stream_reply(llm, messages, params, out)
            print(f"\n{format_stats(stats)}", file=out)
        messages.append({"role": "assistant", "content": reply})

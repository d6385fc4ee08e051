"""HybridEngine: the user-facing API — ``generate`` (transformers-like), ``generate_batch``,
``add_request``/``step`` for driving the engine directly, and ``stats``."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch import nn

from ..cache import HybridRadixCache
from ..layers.context import ForwardMode
from ..memory import MemoryPools
from ..models import PatchHandle, family_of
from .config import EngineConfig, _as_dtype
from .request import Request
from .runner import ModelRunner
from .sampling import Sampler, SamplingParams
from .scheduler import ScheduledBatch, Scheduler
from .speculative import SpeculativeDecoder

# transformers generate() arguments we accept and ignore because they do not change the result
_IGNORED_GENERATE_KWARGS = {"use_cache", "return_dict_in_generate", "output_scores", "output_logits"}


@dataclass
class _LaunchedStep:
    """A step whose forward ran (or, on a GPU, is queued): its requests that sample, in the order
    of ``tokens`` (their sampled next tokens, on the device; None when none samples)."""

    batch: ScheduledBatch
    requests: list[Request]
    tokens: torch.Tensor | None
    # on a GPU: the tokens' pinned host copy and the event after which it holds them
    host_tokens: torch.Tensor | None = None
    tokens_ready: Any = None  # torch.cuda.Event


@dataclass
class StepOutput:
    rid: int
    token: int | None  # None while a prompt is still being prefilled in chunks
    finished: bool
    finish_reason: str | None


def _per_request(base: SamplingParams, n: int) -> list[SamplingParams]:
    """One copy of ``base`` per prompt; prompt ``i`` of a seeded call samples with seed + i."""
    return [
        dataclasses.replace(base, seed=None if base.seed is None else base.seed + i, extra=dict(base.extra))
        for i in range(n)
    ]


def _model_device_and_dtype(model: nn.Module) -> tuple[torch.device, torch.dtype]:
    devices = {p.device for p in model.parameters()}
    if any(d.type == "meta" for d in devices):
        raise ValueError(
            "the model has weights on the meta device (offloaded to CPU/disk by an accelerate device_map, or never "
            "loaded); the engine needs every weight resident on one device: load it with a single-device "
            "device_map (e.g. device_map='cuda:0')"
        )
    if len(devices) > 1:
        raise ValueError(
            f"the model's weights are spread over several devices ({', '.join(sorted(map(str, devices)))}); the "
            "engine serves from one device: load it with a single-device device_map (e.g. device_map='cuda:0')"
        )
    p = next(model.parameters())
    return p.device, p.dtype


def _is_messages(prompt: Any) -> bool:
    """A chat conversation: a non-empty list of message dicts (``{"role": ..., "content": ...}``)."""
    return isinstance(prompt, (list, tuple)) and len(prompt) > 0 and all(isinstance(m, Mapping) for m in prompt)


def _is_text(prompt: Any) -> bool:
    return isinstance(prompt, str) or _is_messages(prompt)


class HybridEngine:
    """Serves one wrapped HF hybrid model. Build it with :func:`hybrid_compile.wrap`."""

    def __init__(self, model: nn.Module, config: EngineConfig, tokenizer: Any = None) -> None:
        self.family = family_of(model)
        self.model = model
        self.config = config
        # a transformers tokenizer: lets generate / generate_batch take and return text (settable)
        self.tokenizer = tokenizer
        model_device, model_dtype = _model_device_and_dtype(model)
        self.device = torch.device(config.device) if config.device is not None else model_device
        if self.device.type != model_device.type or (
            self.device.index is not None and model_device.index is not None and self.device.index != model_device.index
        ):
            raise ValueError(
                f"EngineConfig.device={self.device} but the model is on {model_device}; the engine uses the model's "
                "own weights, so move the model first (model.to(device))"
            )
        self.dtype = config.resolved_dtype(model_dtype)
        if self.dtype != model_dtype:
            raise ValueError(
                f"EngineConfig.dtype={self.dtype} but the model's weights are {model_dtype}; the engine uses the "
                "model's own weights, so convert the model first (model.to(dtype))"
            )
        self.layout = self.family.layout(
            model, kv_dtype=self.dtype, conv_dtype=self.dtype, ssm_dtype=_as_dtype(config.ssm_state_dtype)
        )
        max_context = config.max_context_len or self.layout.max_position_embeddings
        # speculative verify writes the k drafts past a request's last token: k positions of room
        spec_k = config.speculative.num_draft_tokens if config.speculative is not None else 0
        if config.max_total_tokens is not None:
            # a request can use at most the whole KV pool (whole pages of it)
            max_context = min(max_context, config.max_total_tokens // config.page_size * config.page_size - spec_k)
        self.pools = MemoryPools.from_specs(
            self.layout.attention,
            self.layout.mamba,
            device=self.device,
            max_running_requests=config.max_running_requests,
            max_context_len=max_context + spec_k,
            page_size=config.page_size,
            max_total_tokens=config.max_total_tokens,
            mamba_cache_size=config.mamba_cache_size,
            # the prefix cache keeps finished requests' states: room for a few per request slot
            # (with an explicit mamba_cache_size, the slots beyond the running requests')
            mamba_prefix_cache_slots=(
                4 * config.max_running_requests
                if config.enable_prefix_cache and config.mamba_cache_size is None
                else 0
            ),
            memory_fraction=config.memory_fraction,
            # tensor parallelism: one budget for every rank (the smallest rank's), so their pools match
            memory_budget_bytes=config.extra.get("memory_budget_bytes"),
            mamba_full_memory_ratio=config.mamba_full_memory_ratio,
            # capacities from the budget never exceed what the engine can use (cached prefixes
            # included): every request at full context twice over, and 8 Mamba slots per request
            kv_token_cap=2 * config.max_running_requests * max_context,
            mamba_slot_cap=8 * config.max_running_requests,
            # speculative verify: per-step intermediate states for every batch row (+ the padding
            # row of a compiled one-request step)
            num_draft_steps=spec_k + 1 if spec_k else 0,
            max_draft_batch=config.max_running_requests + 1 if spec_k else None,
        )
        self.max_context_len = self.pools.plan.max_context_len - spec_k
        self.patch = PatchHandle()
        # accelerate's device_map hooks live in instance-level `forward`s; a module the family
        # patches bypasses its hook while wrapped (every weight is on self.device, so the hook
        # only moved tensors there) and gets it back on close()
        hooked = [(m, m.__dict__["forward"]) for m in model.modules() if "forward" in m.__dict__]
        self.patch.restores.append(lambda: [m.__dict__.__setitem__("forward", f) for m, f in hooked])
        try:
            self.family.patch(model, self.patch)
            self.runner = ModelRunner(model, self.pools, self.device, config)
            # the rewrite pass's packed projection weights get their own storage again on close()
            self.patch.restores.append(self.runner.release_packed_weights)
        except BaseException:
            self.patch.undo()  # a failed wrap leaves the model exactly as it was
            raise
        self.prefix_cache = (
            HybridRadixCache(self.pools, mamba_align=self.layout.ssm_chunk_size, policy=config.prefix_cache_policy)
            if config.enable_prefix_cache
            else None
        )
        self.scheduler = Scheduler(
            self.pools,
            chunked_prefill_size=config.chunked_prefill_size,
            max_running_requests=config.max_running_requests,
            prefix_cache=self.prefix_cache,
            checkpoint_policy=config.prefix_cache_policy,
            decode_checkpoint_interval=config.prefix_cache_track_interval,
        )
        self.sampler = Sampler()
        try:
            self.speculative = SpeculativeDecoder(self, config.speculative) if config.speculative is not None else None
        except BaseException:
            self.patch.undo()  # e.g. an unusable draft model: the target is left exactly as it was
            raise
        # overlap (see step): the DECODE step launched ahead, whose tokens the next step() returns
        self.overlap = bool(config.extra.get("overlap", True))
        self._ahead: _LaunchedStep | None = None
        self._rids = itertools.count()
        self._arrivals = itertools.count()
        self._requests: dict[int, Request] = {}
        self._counters = dict(
            requests_added=0, requests_finished=0, steps=0, decode_steps=0, extend_steps=0,
            prefill_tokens=0, decode_tokens=0, generated_tokens=0, forward_seconds=0.0,
            overlapped_steps=0,  # decode steps launched before the previous step's tokens were read
        )
        self.warmup_seconds = 0.0
        warm = config.warmup_kernels if config.warmup_kernels is not None else self.device.type == "cuda"
        if warm:
            try:
                self._warm_up_kernels()
            except BaseException:
                self.close()  # a failed wrap leaves the model exactly as it was
                raise

    def _warm_up_kernels(self) -> None:
        """Serve two short requests that share a checkpoint-aligned prefix, then forget them
        (prefix cache emptied, counters and request ids as before): the Triton kernels' JIT
        compiles of every variant serving uses (extend with and without a cached prefix, prefix-
        cache checkpoints, a mixed extend + decode step, decode, speculative verify + commit)
        happen here, not inside the first real requests that need them (about a second per
        kernel on a GPU, which would land in their time to first token)."""
        t0 = time.perf_counter()
        vocab = self.layout.vocab_size
        length = max(1, min(2 * self.layout.ssm_chunk_size + 5, self.max_context_len - 4))
        first = [(7 * i + 3) % vocab for i in range(length)]
        second = first[: length // 2 + 1] + [(5 * i + 1) % vocab for i in range(length - length // 2)]
        second = second[: max(1, self.max_context_len - 4)]
        saved = (dict(self._counters), dict(self.scheduler.cache_counters),  # (flat dicts of numbers)
                 self.scheduler.num_retractions, self.scheduler.new_token_ratio)
        spec = self.speculative
        spec_saved = (dict(spec.counters), dict(spec.acceptance_histogram)) if spec is not None else None
        params = SamplingParams(max_new_tokens=3, ignore_eos=True)
        a = self.add_request(first, params)
        while not self._requests[a].output:
            self.step()
        b = self.add_request(second, params)  # admitted next to a decoding request: a mixed step
        while self.has_unfinished():
            self.step()
        for rid in (a, b):
            self.pop_finished(rid)
        if self.prefix_cache is not None:
            self.prefix_cache.reset()
        (self._counters, self.scheduler.cache_counters, self.scheduler.num_retractions,
         self.scheduler.new_token_ratio) = saved
        if spec is not None:
            spec.counters, spec.acceptance_histogram = spec_saved
            if spec.commit_graphs is not None:
                spec.commit_graphs.replays = 0
        self._rids, self._arrivals = itertools.count(), itertools.count()
        self.warmup_seconds = time.perf_counter() - t0

    # -- lifecycle --------------------------------------------------------------------------
    def close(self) -> None:
        """Undo the model patches (the model behaves exactly as before ``wrap``) and empty the
        prefix cache."""
        if self._ahead is not None:  # a step launched ahead: let it complete, drop its tokens
            self._ahead.tokens.tolist()
            self._ahead = None
        if self.speculative is not None:
            self.speculative.close()
        if self.prefix_cache is not None:
            self.prefix_cache.reset(force=True)
        self.patch.undo()

    def clear_prefix_cache(self) -> None:
        """Free every KV slot and Mamba state the prefix cache holds (and zero its counters).
        Raises RuntimeError while running requests use cached prefixes; no-op without a cache."""
        if self.prefix_cache is not None:
            self.prefix_cache.reset()

    def __enter__(self) -> "HybridEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- requests ---------------------------------------------------------------------------
    def _validate_prompt(self, index: int, prompt: list[int], params: SamplingParams) -> None:
        if len(prompt) == 0:
            raise ValueError(f"prompt {index} is empty")
        vocab = self.layout.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt {index} has token id(s) outside the vocabulary [0, {vocab}): {bad[:5]}")
        # max_context_len never exceeds the KV pool's capacity (see __init__), so this also
        # rejects a request that could never fit in the pool
        need = len(prompt) + params.max_new_tokens
        if need > self.max_context_len:
            raise ValueError(
                f"prompt {index} ({len(prompt)} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds the "
                f"maximum context length {self.max_context_len} (the model's limit, max_context_len, or the KV "
                "pool's capacity max_total_tokens, whichever is smallest)"
            )

    def add_request(self, prompt: Iterable[int], params: SamplingParams | None = None) -> int:
        """Queue one prompt (token ids); returns its request id. See :meth:`step`."""
        return self._add_requests([list(prompt)], [params or SamplingParams()])[0]

    def _add_requests(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[int]:
        # validate everything before queueing anything: bad input loses nothing in flight
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            p.validate()
            self._validate_prompt(i, prompt, p)
        rids = []
        for prompt, p in zip(prompts, params):
            rid = next(self._rids)
            req = Request(rid=rid, prompt=[int(t) for t in prompt], params=p, arrival=next(self._arrivals))
            self._requests[rid] = req
            self.scheduler.add(req)
            self._counters["requests_added"] += 1
            rids.append(rid)
        return rids

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[StepOutput]:
        """Run one engine step (one model forward over a mixed batch, or with speculative
        decoding a draft + verify step of the decoding requests: engine/speculative).

        Overlap: when the step is a DECODE step whose requests all keep decoding whatever tokens
        they sample (no stop tokens, ``max_new_tokens`` not reached) and nothing waits for
        admission, the next DECODE step is scheduled and launched (its input ids: this step's
        sampled tokens, on the device) before this step's tokens are copied to the host, so on
        a GPU the host's bookkeeping and the next step's preparation overlap the GPU's work. That
        step is in flight when ``step`` returns; the next call returns its tokens. Outputs are
        the same as without overlap (``EngineConfig.extra["overlap"] = False`` or setting
        ``engine.overlap = False`` turns it off)."""
        if self.speculative is not None:
            outputs = self.speculative.step()
            if outputs is not None:
                return outputs
            batch = self.scheduler.schedule(decodes=False)
            if batch is None:  # no prefill could run this turn, so verify now
                return self.speculative.step(force=True) or []
            return self._finish(self._launch(batch))
        launched, self._ahead = self._ahead, None
        if launched is None:
            batch = self.scheduler.schedule()
            if batch is None:
                return []
            launched = self._launch(batch)
        if self.overlap and self._keeps_decoding(launched):
            ahead = self.scheduler.schedule_decode_ahead(launched.batch.requests)
            if ahead is not None:
                ahead.input_ids = launched.tokens
                self._ahead = self._launch(ahead)
                self._counters["overlapped_steps"] += 1
        return self._finish(launched)

    def _keeps_decoding(self, launched: "_LaunchedStep") -> bool:
        """Every request of a launched DECODE step samples a token that cannot finish it."""
        if launched.batch.mode is not ForwardMode.DECODE or len(launched.requests) != len(launched.batch.requests):
            return False
        return all(not r.stop_ids and len(r.output) + 1 < r.params.max_new_tokens for r in launched.requests)

    def _launch(self, batch: ScheduledBatch) -> "_LaunchedStep":
        """Run a scheduled step's forward and sample its requests' next tokens, leaving them on
        the device."""
        t0 = time.perf_counter()
        logits = self.runner.forward(batch)
        self.scheduler.commit_checkpoints(batch)  # prefix-cache checkpoints of this step (no-op without)
        c = self._counters
        c["forward_seconds"] += time.perf_counter() - t0
        c["steps"] += 1
        c["decode_steps" if batch.mode.value == "decode" else "extend_steps"] += 1
        sample_rows, sample_reqs = [], []
        for row, (r, n) in enumerate(zip(batch.requests, batch.extend_lens)):
            # prompt positions count as prefill, fed-back output tokens as decode (also inside a
            # mixed step, and when a retracted request recomputes)
            prompt_part = max(0, min(len(r.prompt), r.num_computed + n) - r.num_computed)
            c["prefill_tokens"] += prompt_part
            c["decode_tokens"] += n - prompt_part
            r.num_computed += n
            # every request samples in a step launched ahead (its inputs: tokens still in flight)
            if r.pending == 0 or batch.input_ids is not None:
                sample_rows.append(row)
                sample_reqs.append(r)
        tokens = None
        if sample_reqs:
            rows = logits if len(sample_rows) == logits.shape[0] else logits[sample_rows]
            # inference tensors, as the runner's: a next step launched ahead takes them as its
            # input ids (a compiled forward guards on the tensor kind)
            with torch.inference_mode():
                tokens = self.sampler.sample(rows, [r.rid for r in sample_reqs], [r.params for r in sample_reqs])
            if tokens.device.type == "cuda":
                # start their copy to the host now, so that reading them waits for this step only
                # (not for a step launched after it on the same stream)
                host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
                host.copy_(tokens, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record()
                return _LaunchedStep(batch, sample_reqs, tokens, host, ready)
        return _LaunchedStep(batch, sample_reqs, tokens)

    def _finish(self, launched: "_LaunchedStep") -> list[StepOutput]:
        """Copy a launched step's sampled tokens to the host (waits for its forward) and emit them."""
        if launched.tokens is None:
            return []
        if launched.tokens_ready is not None:
            launched.tokens_ready.synchronize()
            tokens = launched.host_tokens.tolist()
        else:
            tokens = launched.tokens.tolist()
        return [self._emit(r, int(tok)) for r, tok in zip(launched.requests, tokens)]

    def _emit(self, r: Request, token: int) -> StepOutput:
        """Append a generated token to a request; a finished request is handed to the scheduler."""
        r.append_token(token)
        c = self._counters
        c["generated_tokens"] += 1
        if r.is_finished:
            self.scheduler.finish(r)
            self.sampler.release(r.rid)
            if self.speculative is not None:
                self.speculative.release(r.rid)
            c["requests_finished"] += 1
        return StepOutput(r.rid, token, r.is_finished, r.finish_reason)

    def pop_finished(self, rid: int) -> Request:
        req = self._requests[rid]
        if not req.is_finished:
            raise ValueError(f"request {rid} has not finished")
        return self._requests.pop(rid)

    # -- transformers-like API ----------------------------------------------------------------
    def _sampling_params(
        self,
        generation_config: Any = None,
        *,
        max_new_tokens=None,
        do_sample=None,
        temperature=None,
        top_k=None,
        top_p=None,
        eos_token_id=None,
        stop_token_ids=None,
        seed=None,
        ignore_eos=False,
        **unknown,
    ) -> SamplingParams:
        unsupported = sorted(k for k in unknown if k not in _IGNORED_GENERATE_KWARGS)
        if unsupported:
            raise ValueError(f"generate(): unsupported argument(s): {', '.join(unsupported)}")
        base = generation_config if generation_config is not None else getattr(self.model, "generation_config", None)

        def pick(value, name, default):
            if value is not None:
                return value
            v = getattr(base, name, None) if base is not None else None
            return default if v is None else v

        if base is not None:
            if getattr(base, "num_beams", 1) not in (None, 1):
                raise ValueError("generate(): beam search (num_beams > 1) is not supported")
            if getattr(base, "num_return_sequences", 1) not in (None, 1):
                raise ValueError("generate(): num_return_sequences > 1 is not supported")
        eos = pick(eos_token_id, "eos_token_id", ())
        eos = (eos,) if isinstance(eos, int) else tuple(int(e) for e in eos)
        if not eos and eos_token_id is None and getattr(self.tokenizer, "eos_token_id", None) is not None:
            eos = (int(self.tokenizer.eos_token_id),)  # the generation config names none: the tokenizer's
        default_new = getattr(base, "max_new_tokens", None) or 20  # transformers' default is 20
        return SamplingParams(
            max_new_tokens=int(max_new_tokens if max_new_tokens is not None else default_new),
            do_sample=bool(pick(do_sample, "do_sample", False)),
            temperature=float(pick(temperature, "temperature", 1.0)),
            top_k=int(pick(top_k, "top_k", 0)),
            top_p=float(pick(top_p, "top_p", 1.0)),
            seed=seed,
            eos_token_ids=eos,
            stop_token_ids=tuple(stop_token_ids or ()),
            ignore_eos=ignore_eos,
        )

    # -- text -----------------------------------------------------------------------------------
    def _require_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise ValueError(
                "text input needs a tokenizer and this engine has none: pass tokenizer= to wrap() or "
                "from_pretrained(), set engine.tokenizer = AutoTokenizer.from_pretrained(...), or pass token ids"
            )
        return self.tokenizer

    def encode(self, prompt: str | list[dict]) -> list[int]:
        """A string (tokenized as transformers does, special tokens added) or chat messages (the
        tokenizer's chat template with ``add_generation_prompt=True``) -> token ids."""
        tok = self._require_tokenizer()
        if isinstance(prompt, str):
            return [int(t) for t in tok(prompt)["input_ids"]]
        if not _is_messages(prompt):
            raise TypeError(f"expected a string or a list of chat message dicts, got {type(prompt).__name__}")
        text = tok.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=False)
        return [int(t) for t in tok(text, add_special_tokens=False)["input_ids"]]

    def decode(self, tokens: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._require_tokenizer().decode(list(tokens), skip_special_tokens=skip_special_tokens)

    def generate_batch(self, prompts: list, skip_special_tokens: bool = True, **sampling) -> list:
        """Generate for several prompts with continuous batching; returns the new tokens of
        each prompt, in order. ``sampling``: max_new_tokens, do_sample, temperature, top_k,
        top_p, eos_token_id, stop_token_ids, seed (per-request seeds derive from it), ignore_eos.

        With a tokenizer, a prompt may also be a string or a chat conversation (a list of message
        dicts, rendered with the chat template and the generation prompt); its result is then the
        decoded text of its new tokens (``skip_special_tokens``), not token ids."""
        if isinstance(prompts, str) or _is_messages(prompts):
            raise TypeError("generate_batch takes a list of prompts; for one prompt use generate()")
        prompts = list(prompts)
        is_text = [_is_text(p) for p in prompts]
        prompts = [self.encode(p) if t else list(p) for p, t in zip(prompts, is_text)]
        base = self._sampling_params(**sampling)
        rids = self._add_requests(prompts, _per_request(base, len(prompts)))
        pending = set(rids)
        while pending:
            for out in self.step():
                if out.finished:
                    pending.discard(out.rid)
        outputs = [self.pop_finished(rid).output for rid in rids]
        return [self.decode(o, skip_special_tokens) if t else o for o, t in zip(outputs, is_text)]

    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        generation_config: Any = None,
        streamer: Any = None,
        pad_token_id: int | None = None,
        **kwargs,
    ) -> torch.Tensor | str | list[str]:
        """Like ``model.generate``: ``input_ids [B, L]`` (left-padded rows with
        ``attention_mask``) -> ``[B, L + new]``; rows that stop early are padded with the pad
        token (or EOS). ``streamer`` (a transformers streamer) needs batch size 1.

        With a tokenizer, ``input_ids`` may instead be text: a string or a chat conversation (list
        of message dicts) -> the generated text (``skip_special_tokens=True`` by default); a list
        of them -> a list of texts (through :meth:`generate_batch`)."""
        if _is_text(input_ids) or (
            isinstance(input_ids, (list, tuple)) and input_ids and all(_is_text(p) for p in input_ids)
        ):
            return self._generate_text(input_ids, attention_mask, generation_config, streamer, **kwargs)
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, length], got shape {tuple(input_ids.shape)}")
        params = self._sampling_params(generation_config, **kwargs)
        rows = input_ids.tolist()
        if attention_mask is not None:
            if attention_mask.shape != input_ids.shape:
                raise ValueError("attention_mask must have the shape of input_ids")
            mask = attention_mask.bool().tolist()
            prompts = [[t for t, m in zip(row, mrow) if m] for row, mrow in zip(rows, mask)]
        else:
            prompts = rows
        if streamer is not None and len(prompts) != 1:
            raise ValueError("streaming supports batch size 1 only (as in transformers)")
        rids = self._add_requests(prompts, _per_request(params, len(prompts)))
        if streamer is not None:
            streamer.put(input_ids.cpu())
        pending = set(rids)
        while pending:
            for out in self.step():
                if streamer is not None and out.token is not None and out.rid in pending:
                    streamer.put(torch.tensor([out.token]))
                if out.finished:
                    pending.discard(out.rid)
        if streamer is not None:
            streamer.end()
        outputs = [self.pop_finished(rid).output for rid in rids]
        if pad_token_id is None:
            cfg = generation_config if generation_config is not None else getattr(self.model, "generation_config", None)
            pad_token_id = getattr(cfg, "pad_token_id", None)
            if pad_token_id is None:
                pad_token_id = params.eos_token_ids[0] if params.eos_token_ids else 0
        width = max(len(o) for o in outputs)
        new = torch.full((len(outputs), width), int(pad_token_id), dtype=torch.long)
        for i, o in enumerate(outputs):
            new[i, : len(o)] = torch.tensor(o, dtype=torch.long)
        return torch.cat([input_ids.cpu().long(), new], dim=1).to(input_ids.device)

    def _generate_text(self, prompts, attention_mask, generation_config, streamer, skip_special_tokens=True, **kw):
        if attention_mask is not None:
            raise ValueError("attention_mask goes with token ids; text prompts are tokenized by the engine")
        if not _is_text(prompts):  # a list of prompts
            if streamer is not None:
                raise ValueError("streaming supports batch size 1 only (as in transformers)")
            return self.generate_batch(
                list(prompts), skip_special_tokens=skip_special_tokens, generation_config=generation_config, **kw
            )
        ids = self.encode(prompts)
        out = self.generate(
            torch.tensor([ids], dtype=torch.long), generation_config=generation_config, streamer=streamer, **kw
        )
        return self.decode(out[0, len(ids):].tolist(), skip_special_tokens)

    # -- observability -------------------------------------------------------------------------
    def stats(self) -> dict:
        c = dict(self._counters)
        c["retractions"] = self.scheduler.num_retractions
        c["waiting"] = len(self.scheduler.waiting)
        c["running"] = len(self.scheduler.running)
        secs = c["forward_seconds"]
        c["tokens_per_second"] = (c["prefill_tokens"] + c["decode_tokens"]) / secs if secs else 0.0
        c["memory"] = self.pools.summary()
        c["compile"] = self.runner.compile_stats()
        c["warmup_kernels_seconds"] = self.warmup_seconds
        if self.speculative is not None:
            c["speculative"] = self.speculative.stats()
        if self.prefix_cache is not None:
            pc = {**self.prefix_cache.stats(), **self.scheduler.cache_counters}
            # prefix tokens served from the cache / tokens of the admitted requests
            pc["token_hit_rate"] = pc["admitted_hit_tokens"] / pc["admitted_tokens"] if pc["admitted_tokens"] else 0.0
            c["prefix_cache"] = pc
        return c

"""HybridEngine: requests in, one step at a time — ``add_request`` / ``step`` / ``abort``, the step
itself (schedule -> forward batch -> forward -> sample -> commit / emit), lifecycle and ``stats``.
The transformers-compatible ``generate`` / ``generate_batch`` on top of it are in
:mod:`.generate_api` (a mixin of :class:`HybridEngine`).

A failed step loses nothing and corrupts nothing. A step is a transaction: its scheduler
decisions and slot allocations become the requests' own only when the step commits (its
sampled tokens are emitted). Whatever raises between the launch of a forward and that commit
(an exception inside the model, a CUDA error or out-of-memory, a user's logits processor,
Ctrl-C) rolls the step back before the exception propagates, unchanged, to the caller:

- **Recompute, not restore.** The recurrent layers update their conv windows and SSM states in
  place, layer by layer, so a forward that stops half-way leaves the states of its requests
  between two sequence lengths. Restoring them would need a copy of every affected state before
  every step (megabytes per request per step on a real model, paid on every healthy step);
  instead the requests of a failed step are *recomputed from their last consistent point*:
  their slots are freed (KV slots of the step included) and they go back to the front of the
  queue with their prompt and the output emitted so far (``Scheduler.requeue``), to be
  prefilled again from their longest prefix-cache checkpoint, or from the prompt. The cost is
  paid only when a step fails. K/V written by the failed step went to slots that are freed with
  it, and prefix-cache checkpoints are handed to the tree only after a complete forward, so no
  half-written state is ever seen by a later step.
- A speculative verify step leaves the main states untouched (only the intermediate buffers
  are written), so before its commit only the draft tokens' KV slots are freed; the draft
  source forgets its state of the requests it was proposing for (``engine/speculative``).
- With overlap, a failure of the decode step launched ahead still emits the tokens of the step
  before it (they are valid): they are held back and returned by the next :meth:`step`.
- The random generators of sampled requests and the step counters are restored, so a seeded
  request draws the same tokens as if the step had never run.
- **The commit is two phases.** First every row's host-side stop checks run (stop strings, the
  user's ``stopping_criteria``, ``max_time``: :meth:`HybridEngine._host_stop`), on the row's
  tokens as they would be once appended, changing nothing; then the rows are committed (tokens
  appended, finished requests handed to the scheduler), which runs no user code. If a row's
  checks raise, the rows before it commit (their outputs come with the next :meth:`step`), and
  that row and the rows after it, whose checks never ran, are rolled back as above (recomputed,
  their generators restored): no request is left with its KV or state advanced past its output,
  and every one of them ends with the same tokens as without the fault. A speculative verify step
  runs its checks before its commit too; a raise there undoes the whole verify step.

``generate`` / ``generate_batch`` end the requests they added when they raise (for whatever
reason: a failed step, a streamer that raises, Ctrl-C between steps): :meth:`abort` frees their
slots and prefix-cache locks; other callers' requests continue untouched. The outputs of other
callers' requests that such a call's steps produce are not its own: they wait for the next
:meth:`step` (whether the call returns or raises), so a caller driving :meth:`step` never misses
one.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import time
from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch import nn

from ..cache import HybridRadixCache
from ..compilation.rewrite import pack_parameters
from ..layers.context import ForwardMode
from ..memory import MemoryPools
from ..memory.host_pool import HostPool
from .elastic import ElasticPools
from ..models import PatchHandle, family_of
from .config import EngineConfig, _as_dtype
from .generate_api import GenerateAPI
from .request import Request, StepOutput
from ..models.base import install_attention
from ..models.fused_experts import install_fused_experts, resolve_fused_moe, resolve_fused_routers
from ..models.fused_router import install_fused_routers
from ..models.shared_expert_fold import install_shared_expert_folds
from ..models.mtp import load_mtp_head
from .speculative.token_map import read_token_map
from .runner import ModelRunner, hidden_states_forward
from .sampling import Sampler, SampleResult, SamplingParams, logprob_entries
from .scheduler import ScheduledBatch, Scheduler
from .speculative import SpeculativeDecoder, build_draft_source
from .startup import Startup

# finished requests whose timings stats() summarises (the most recent ones)
_TIMING_WINDOW = 10_000


@dataclass
class _LaunchedStep:
    """A step whose forward ran (or, on a GPU, is queued): its requests that sample, in the order
    of ``tokens`` (their sampled next tokens, on the device; None when none samples)."""

    batch: ScheduledBatch
    requests: list[Request]
    tokens: torch.Tensor | None
    # on a GPU: pinned host copies of the tokens (and log-probabilities) and the event after which
    # they hold them
    host_tokens: torch.Tensor | None = None
    tokens_ready: Any = None  # torch.cuda.Event
    # the sampled requests' generator states before the step (Sampler.snapshot): its roll-back
    generators: dict = dataclasses.field(default_factory=dict)
    result: SampleResult | None = None
    host_logprobs: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass
class _StepUndo:
    """What a step's roll-back needs: the requests it touched (the batch's, plus sequences forked
    from them, ``n > 1``) and the generator states of its sampled requests before it."""

    requests: list[Request]
    generators: dict = dataclasses.field(default_factory=dict)


def _percentiles(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    v = sorted(values)
    pick = lambda q: v[min(len(v) - 1, int(round(q * (len(v) - 1))))]  # noqa: E731
    return dict(mean=sum(v) / len(v), p50=pick(0.5), p90=pick(0.9), p99=pick(0.99), count=len(v))


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
    # the activation dtype: the first parameter that is not an FP8 weight (embeddings come first)
    p = next((p for p in model.parameters() if p.dtype != torch.float8_e4m3fn), next(model.parameters()))
    return p.device, p.dtype


class HybridEngine(GenerateAPI):
    """Serves one wrapped HF hybrid model. Build it with :func:`hybrid_compile.wrap`.

    ``startup``: the :class:`~.startup.Startup` that times (and, with progress on, shows) the
    construction's phases; default: a new one, silent. ``stats()["startup"]`` reports it.
    ``mtp_head``: speculative method "mtp" with the head already loaded (tensor parallelism: the
    rank's shard of it, ``distributed/loading.py``); default: loaded here from the checkpoint."""

    def __init__(self, model: nn.Module, config: EngineConfig, tokenizer: Any = None,
                 startup: Startup | None = None, mtp_head: nn.Module | None = None) -> None:
        config.validate()  # (a config built directly, not through from_args)
        self.startup = startup if startup is not None else Startup()
        self.family = family_of(model)
        if config.tensor_parallel_all_reduce == "one_shot":
            raise ValueError("EngineConfig.tensor_parallel_all_reduce='one_shot' applies to tensor parallelism "
                             "(hc.from_pretrained(dir, tensor_parallel_size=N > 1)); this engine serves one device")
        self.model = model
        self.config = config
        # a transformers tokenizer: lets generate / generate_batch take and return text (settable)
        self.tokenizer = tokenizer
        from ..quantization import fp8_weight_bytes, has_fp8_layers, quantize_model

        if config.quantization == "fp8" and not has_fp8_layers(model):
            quantize_model(model)
        # the weights as served (stats()["quantization"]): e4m3 bytes (FP8 layers) and every other parameter's
        fp8_bytes, other_bytes = fp8_weight_bytes(model)
        self.quantization = {"method": "fp8" if fp8_bytes else None, "fp8_weight_bytes": fp8_bytes,
                             "other_weight_bytes": other_bytes}
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
        warm = config.warmup_kernels if config.warmup_kernels is not None else self.device.type == "cuda"
        is_mtp = config.speculative is not None and config.speculative.method == "mtp"
        if mtp_head is not None and not is_mtp:
            raise ValueError("HybridEngine(mtp_head=...) needs EngineConfig.speculative with method 'mtp'")
        # (compile and capture: the runner's, CompiledGraphs.setup)
        self.startup.plan(*("load",) * (is_mtp and mtp_head is None), "pools", "patch",
                          *("speculative",) * (config.speculative is not None), *("warmup",) * warm)
        kv_dtype = config.resolved_kv_cache_dtype(self.dtype)
        self.layout = self.family.layout(
            model, kv_dtype=kv_dtype, conv_dtype=self.dtype, ssm_dtype=_as_dtype(config.ssm_state_dtype),
        )
        max_context = config.max_context_len or self.layout.max_position_embeddings
        # speculative verify writes the k drafts past a request's last token: k positions of room
        # (a draft tree: its nodes, each in a KV slot of the verify row)
        spec_k = config.speculative.draft_nodes if config.speculative is not None else 0
        if config.max_total_tokens is not None:
            # a request can use at most the whole KV pool (whole pages of it)
            max_context = min(max_context, config.max_total_tokens // config.page_size * config.page_size - spec_k)
        # speculative method "mtp": the checkpoint's MTP head; its attention layer is one more
        # full-attention layer of the KV pool (its KV lives in the slots of the target's tokens)
        self.mtp_head = mtp_head
        if is_mtp and mtp_head is None:
            with self.startup.phase("load"):
                self.mtp_head = load_mtp_head(model, config.speculative.mtp_checkpoint)
        if is_mtp and config.speculative.draft_token_map is not None:
            # the head drafts over the map's ids only (its own LM head of their rows; token_map.py)
            self.mtp_head.restrict_vocabulary(read_token_map(config.speculative.draft_token_map, self.layout.vocab_size))
        if config.elastic_pools and not (self.layout.attention and self.layout.mamba):
            raise ValueError("EngineConfig.elastic_pools needs a model with both full-attention and linear layers")
        with self.startup.phase("pools"):
            self.pools = MemoryPools.from_specs(
                self.layout.attention + (self.mtp_head.attention_specs(kv_dtype) if self.mtp_head is not None else []),
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
                elastic=config.elastic_pools,
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
            # the prefix cache's host tier (before patching: a bad size fails with the model untouched)
            self.host_pool = (
                HostPool.from_budget(self.pools.kv, self.pools.mamba, config.prefix_cache_host_bytes,
                                     fraction=config.prefix_cache_host_fraction)
                if config.prefix_cache_host_tier
                else None
            )
        self.max_context_len = self.pools.plan.max_context_len - spec_k
        self.patch = PatchHandle()
        # accelerate's device_map hooks live in instance-level `forward`s; a module the family
        # patches bypasses its hook while wrapped (every weight is on self.device, so the hook
        # only moved tensors there) and gets it back on close()
        hooked = [(m, m.__dict__["forward"]) for m in model.modules() if "forward" in m.__dict__]
        self.patch.restores.append(lambda: [m.__dict__.__setitem__("forward", f) for m, f in hooked])
        try:
            with self.startup.phase("patch"):
                self.family.patch(model, self.patch)
                # EngineConfig.fused_moe (None: on for CUDA models whose experts all fit the fused
                # path): the experts modules patched (0: transformers' experts forward)
                self.fused_moe = resolve_fused_moe(model, config.fused_moe, self.device)
                self.fused_experts = install_fused_experts(model, self.patch, self.fused_moe)
                # ... and their softmax top-k routers (0: transformers' router forward; also on before
                # FP8 experts)
                routers = resolve_fused_routers(model, config.fused_moe, self.device, self.fused_moe)
                self.fused_routers = install_fused_routers(model, self.patch, routers)
                # ... and a shared expert of the routed experts' shape served as one more routed expert
                # (models/shared_expert_fold.py; extra["fold_shared_experts"]=False keeps it apart): where
                # the experts are fused, or FP8 behind the fused routers
                fold = routers and config.extra.get("fold_shared_experts", True)
                # (laid out for the rewrite pass's projection packing when the engine compiles with it)
                packs = pack_parameters if config.resolved_compile(self.device) and config.rewrite_passes else None
                self.folded_shared_experts = install_shared_expert_folds(model, self.patch, fold, packs)
                if self.mtp_head is not None:
                    self.fused_experts += install_fused_experts(self.mtp_head.layers, self.patch, self.fused_moe,
                                                                required=False)
                    self.fused_routers += install_fused_routers(self.mtp_head.layers, self.patch, routers)
                    self.folded_shared_experts += install_shared_expert_folds(self.mtp_head.layers, self.patch, fold,
                                                                              packs)
                    install_attention(self.mtp_head, self.patch)
            # an MTP head reads the target's final hidden states: the forward returns them too
            self.runner = ModelRunner(model, self.pools, self.device, config,
                                      forward_fn=hidden_states_forward if self.mtp_head is not None else None,
                                      startup=self.startup)
            # the rewrite pass's packed projection weights get their own storage again on close()
            self.patch.restores.append(self.runner.release_packed_weights)
        except BaseException:
            self.patch.undo()  # a failed wrap leaves the model exactly as it was
            raise
        # the radix tree, None when off (the scheduler then runs on a NullPrefixCache)
        self.prefix_cache = (
            HybridRadixCache(self.pools, mamba_align=self.layout.ssm_chunk_size, policy=config.prefix_cache_policy,
                             host_pool=self.host_pool)
            if config.enable_prefix_cache
            else None
        )
        self.scheduler = Scheduler(
            self.pools,
            chunked_prefill_size=config.chunked_prefill_size,
            max_running_requests=config.max_running_requests,
            prefix_cache=self.prefix_cache,
            decode_checkpoint_interval=config.prefix_cache_track_interval,
            split_mixed_steps=config.extra.get("split_mixed_steps", True),
        )
        if config.elastic_pools:
            self.scheduler.elastic = ElasticPools(self.pools, self.pools_resized, cache=self.prefix_cache,
                                                  running=lambda: self.scheduler.running)
        self.sampler = Sampler(self.layout.vocab_size, self.device, config.max_running_requests)
        try:
            self.speculative = None
            if config.speculative is not None:
                with self.startup.phase("speculative"):
                    self.speculative = self._speculative_decoder()
        except BaseException:
            self.patch.undo()  # e.g. an unusable draft model: the target is left exactly as it was
            raise
        # overlap (see step): the DECODE step launched ahead, whose tokens the next step() returns
        self.overlap = bool(config.extra.get("overlap", True))
        self._ahead: _LaunchedStep | None = None
        self._rids = itertools.count()
        self._arrivals = itertools.count()
        self._requests: dict[int, Request] = {}
        # outputs produced but not returned yet (the next step() returns them first): tokens of a
        # step whose successor failed, and aborted requests' final outputs
        self._undelivered: list[StepOutput] = []
        self._counters = dict(
            requests_added=0, requests_finished=0, steps=0, decode_steps=0, extend_steps=0,
            # extend steps with decode rows, which the layer ops run through their decode paths
            # (ForwardMetadata.mixed_parts), and those rows
            mixed_steps=0, mixed_decode_rows=0,
            prefill_tokens=0, decode_tokens=0, generated_tokens=0, forward_seconds=0.0,
            overlapped_steps=0,  # decode steps launched before the previous step's tokens were read
            requests_aborted=0,
            failed_steps=0,  # steps rolled back by an exception (module docstring)
            requests_recomputed=0,  # requests of failed steps sent back to be recomputed
            # n > 1: sequences started from a copy of their first sequence's prefilled prompt, and the
            # prompt tokens they did not prefill again
            forked_requests=0, forked_prompt_tokens=0,
        )
        self._timings: collections.deque = collections.deque(maxlen=_TIMING_WINDOW)  # (ttft, tpot)
        self.warmup_seconds = 0.0
        if warm:
            try:
                with self.startup.phase("warmup"):
                    self._warm_up_kernels()
            except BaseException:
                self.close()  # a failed wrap leaves the model exactly as it was
                raise
        self.startup.finish()

    def _speculative_decoder(self) -> SpeculativeDecoder:
        """The decoder of ``EngineConfig.speculative``: the parts of this engine it drives and its
        callbacks into it, passed explicitly (it never sees the engine; the draft source reads the
        engine as a ``DraftTarget``)."""
        spec = self.config.speculative
        return SpeculativeDecoder(
            spec, lambda: build_draft_source(spec, self), scheduler=self.scheduler, runner=self.runner,
            sampler=self.sampler, pools=self.pools, emit=self._emit, host_stop=self._host_stop,
            roll_back=self._roll_back,
            count_step=self._count_verify_step, vocab_size=self.layout.vocab_size,
            # EngineConfig.extra["speculative_commit_graphs"] = False: one op launch per state tensor
            commit_graphs=bool(self.config.extra.get("speculative_commit_graphs", True)),
        )

    def _count_verify_step(self, tokens: int, seconds: float) -> None:
        """A speculative verify step that kept ``tokens`` tokens in ``seconds`` of forward time."""
        c = self._counters
        c["steps"] += 1
        c["decode_tokens"] += tokens
        c["forward_seconds"] += seconds

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
        source_counters = getattr(spec.source, "counters", None) if spec is not None else None
        source_saved = dict(source_counters) if isinstance(source_counters, dict) else None  # (the MTP head's)
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
        self.scheduler.cache.reset()
        (self._counters, self.scheduler.cache_counters, self.scheduler.num_retractions,
         self.scheduler.new_token_ratio) = saved
        if spec is not None:
            spec.counters, spec.acceptance_histogram = spec_saved
            if source_saved is not None:
                spec.source.counters = source_saved
            if spec.commit_graphs is not None:
                spec.commit_graphs.replays = 0
        self.runner.graphs.forget_replays()
        self._rids, self._arrivals = itertools.count(), itertools.count()
        self._timings.clear()
        self.warmup_seconds = time.perf_counter() - t0

    # -- lifecycle --------------------------------------------------------------------------
    def close(self) -> None:
        """Undo the model patches (the model behaves exactly as before ``wrap``), empty the prefix
        cache and let go of the compiled forward and its CUDA graphs (``ModelRunner.release``: a
        closed engine holds no device memory but its pools, which go with the engine)."""
        if self._ahead is not None:  # a step launched ahead: let it complete, drop its tokens
            self._ahead.tokens.tolist()
            self._ahead = None
        if self.speculative is not None:
            self.speculative.close()
        self.scheduler.cache.reset(force=True)
        self.patch.undo()
        self.runner.release()

    def clear_prefix_cache(self) -> None:
        """Free every KV slot and Mamba state the prefix cache holds (and zero its counters).
        Raises RuntimeError while running requests use cached prefixes; no-op without a cache."""
        self.scheduler.cache.reset()

    def __enter__(self) -> "HybridEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- requests ---------------------------------------------------------------------------
    def validate_request(self, prompt: Iterable[int], params: SamplingParams | None = None) -> None:
        """Raise ValueError for a request :meth:`add_request` would refuse (bad sampling values, an
        empty prompt, token ids outside the vocabulary, prompt + max_new_tokens over the context).
        Reads only the engine's fixed configuration: safe to call from any thread."""
        self.front.validate_request(prompt, params)

    def request(self, rid: int) -> Request:
        """The request ``rid`` (queued, running, or finished and not yet popped)."""
        return self._requests[rid]

    def add_request(self, prompt: Iterable[int], params: SamplingParams | None = None) -> int:
        """Queue one prompt (token ids); returns its request id. With ``params.n > 1`` the prompt's
        ``n`` sequences get consecutive ids from the returned one (:meth:`sequence_ids`; each
        :class:`StepOutput` names its ``group`` and ``index``). See :meth:`step`."""
        return self._add_requests([list(prompt)], [params or SamplingParams()])[0]

    def sequence_ids(self, rid: int) -> list[int]:
        """The request ids of the sequences of ``rid``'s prompt (``n`` of them), in order."""
        first = self._requests[rid]
        return list(range(first.group, first.group + first.params.n))

    def _stop_criteria(self, p: SamplingParams) -> list[tuple[str, Any]]:
        from transformers.generation.stopping_criteria import StopStringCriteria

        return [(text, StopStringCriteria(self.tokenizer, [text])) for text in p.stop]

    def _add_requests(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[int]:
        # validate everything before queueing anything: bad input loses nothing in flight
        front = self.front
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            front.check_params(i, p)
            front.check_prompt(i, prompt, p)
        stops = [self._stop_criteria(p) if p.stop else [] for p in params]
        rids = []
        now = time.perf_counter()
        for prompt, p, stop in zip(prompts, params, stops):
            tokens = [int(t) for t in prompt]
            group = []
            for j in range(p.n):
                # sequence j samples with seed + j; each is a request of n = 1 of its group
                sp = p if p.n == 1 else dataclasses.replace(p, seed=None if p.seed is None else p.seed + j)
                rid = next(self._rids)
                req = Request(rid=rid, prompt=tokens, params=sp, arrival=next(self._arrivals),
                              group=group[0].rid if group else -1, index=j, arrival_time=now)
                req.stop_criteria = stop
                self._requests[rid] = req
                self._counters["requests_added"] += 1
                rids.append(rid)
                group.append(req)
            # the first sequence is prefilled; the others start from copies of its state (_fork)
            group[0].forks = group[1:]
            self.scheduler.add(group[0])
        return rids

    def has_unfinished(self) -> bool:
        """Requests wait or run, or outputs wait to be returned by :meth:`step`."""
        return bool(self._undelivered) or self.scheduler.has_work()

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
        ``engine.overlap = False`` turns it off).

        If the step raises, it is rolled back first (module docstring) and the exception
        propagates unchanged; outputs it could not return come with the next call."""
        delivered, self._undelivered = self._undelivered, []
        try:
            return delivered + self._step()
        except BaseException:
            self._undelivered = delivered + self._undelivered
            raise

    def _step(self) -> list[StepOutput]:
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
                try:
                    self._ahead = self._launch(ahead)  # (rolled back if it fails)
                except BaseException:
                    # the step before it is complete: its tokens are emitted (the next step()
                    # returns them) and the requests recompute from there
                    try:
                        self._undelivered += self._finish(launched)
                    except BaseException:
                        pass  # _finish rolled back what it could not commit (its commits wait in _undelivered)
                    raise
                self._counters["overlapped_steps"] += 1
        return self._finish(launched)

    def _roll_back(self, requests: list[Request], generators: dict) -> None:
        """Undo a step that raised before its commit (module docstring): the sampled requests'
        generators as before the step, and every unfinished request of it sent back to be
        recomputed from its last consistent point (``Scheduler.requeue``)."""
        unique = list({id(r): r for r in requests}.values())
        self.sampler.roll_back(generators, [r.rid for r in unique])
        live = [r for r in unique if not r.is_finished]
        self.scheduler.requeue(live)
        self._counters["failed_steps"] += 1
        self._counters["requests_recomputed"] += len(live)

    def _keeps_decoding(self, launched: "_LaunchedStep") -> bool:
        """Every request of a launched DECODE step samples a token that cannot finish it (and none
        needs its tokens on the host before its next step)."""
        if launched.batch.mode is not ForwardMode.DECODE or len(launched.requests) != len(launched.batch.requests):
            return False
        return all(not r.stop_ids and len(r.output) + 1 < r.params.max_new_tokens and not r.params.needs_history
                   and r.params.max_time is None for r in launched.requests)

    def _fork(self, sample_rows: list[int], sample_reqs: list[Request]) -> None:
        """``n > 1``: the other sequences of a prompt whose first sequence just finished its
        prefill start from copies of its state (``Scheduler.fork``) and sample their first token
        from its logits row; one that does not fit now is queued and prefilled by itself."""
        for row, r in list(zip(sample_rows, sample_reqs)):
            if not r.forks:
                continue
            for child in r.forks:
                if self.scheduler.fork(r, child):
                    sample_rows.append(row)
                    sample_reqs.append(child)
                    self._counters["forked_requests"] += 1
                    self._counters["forked_prompt_tokens"] += r.num_computed
                else:
                    self.scheduler.add(child)
            r.forks = []

    def _launch(self, batch: ScheduledBatch) -> "_LaunchedStep":
        """Run a scheduled step's forward and sample its requests' next tokens, leaving them on
        the device. If anything raises, the step is rolled back first (:meth:`_roll_back`)."""
        undo = _StepUndo(list(batch.requests))
        try:
            launched = self._forward_and_sample(batch, undo)
        except BaseException:
            self._roll_back(undo.requests, undo.generators)
            raise
        launched.generators = undo.generators
        return launched

    def _forward_and_sample(self, batch: ScheduledBatch, undo: "_StepUndo") -> "_LaunchedStep":
        t0 = time.perf_counter()
        logits = self.runner.forward(batch)
        self.scheduler.commit_checkpoints(batch)  # prefix-cache checkpoints of this step (no-op without)
        c = self._counters
        c["forward_seconds"] += time.perf_counter() - t0
        c["steps"] += 1
        c["decode_steps" if batch.mode.value == "decode" else "extend_steps"] += 1
        if batch.decode_rows is not None:
            c["mixed_steps"] += 1
            c["mixed_decode_rows"] += batch.decode_rows[1] - batch.decode_rows[0]
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
        if self.speculative is not None:  # (an MTP draft source reads the step's hidden states)
            self.speculative.observe(batch)
        self._fork(sample_rows, sample_reqs)
        undo.requests += [r for r in sample_reqs if all(r is not q for q in undo.requests)]  # n > 1: forked
        if not sample_reqs:
            return _LaunchedStep(batch, sample_reqs, None)
        undo.generators = self.sampler.snapshot(sample_reqs)
        rows = logits if sample_rows == list(range(logits.shape[0])) else logits[sample_rows]
        # inference tensors, as the runner's: a next step launched ahead takes them as its
        # input ids (a compiled forward guards on the tensor kind)
        with torch.inference_mode():
            result = self.sampler.sample_rows(rows, [r.rid for r in sample_reqs], [r.params for r in sample_reqs],
                                              sample_reqs, in_flight=1 if batch.input_ids is not None else 0)
        tokens = result.tokens
        if tokens.device.type == "cuda":
            # start their copy to the host now, so that reading them waits for this step only
            # (not for a step launched after it on the same stream)
            host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            host.copy_(tokens, non_blocking=True)
            host_lp = None
            if result.logprob_rows:
                host_lp = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                                for t in (result.logprob_values, result.logprob_ids))
            ready = torch.cuda.Event()
            ready.record()
            return _LaunchedStep(batch, sample_reqs, tokens, host, ready, result, host_lp)
        lp = (result.logprob_values, result.logprob_ids) if result.logprob_rows else None
        return _LaunchedStep(batch, sample_reqs, tokens, result=result, host_logprobs=lp)

    def _finish(self, launched: "_LaunchedStep") -> list[StepOutput]:
        """Copy a launched step's sampled tokens to the host (waits for its forward) and emit them:
        the step's commit. If the copy raises (an error of the forward surfacing, Ctrl-C while
        waiting), the step is rolled back, with the step launched after it on the same requests.

        The commit runs in two phases (module docstring): first every row's host-side stop checks
        (stop strings, the user's ``stopping_criteria``), which change nothing; then the rows are
        committed, which runs no user code. If a row's checks raise, the rows before it commit,
        that row and the rows after it are rolled back (recomputed), the committed rows' outputs
        wait for the next :meth:`step`, and the exception propagates unchanged."""
        if launched.tokens is None:
            return []
        try:
            if launched.tokens_ready is not None:
                launched.tokens_ready.synchronize()
                tokens = launched.host_tokens.tolist()
            else:
                tokens = launched.tokens.tolist()
        except BaseException:
            self._roll_back_launched(launched)
            raise
        result = launched.result
        reqs = launched.requests
        scores = {} if result is None else result.scores
        # 1. the checks that run user code, before anything is committed
        stops, error = [], None
        for i, (r, tok) in enumerate(zip(reqs, tokens)):
            try:
                stops.append(self._host_stop(r, [int(tok)], scores.get(i)))
            except BaseException as e:
                error = e
                break
        if error is not None and self._ahead is not None:  # (a step launched ahead reads these tokens)
            self._roll_back_launched(launched)
            raise error
        committed = len(stops)
        if error is not None:
            failed = reqs[committed:]
            self._roll_back(failed, {rid: g for rid, g in launched.generators.items()
                                     if any(r.rid == rid for r in failed)})
        # 2. the commit of the rows whose checks ran
        logprobs = {}
        if launched.host_logprobs is not None:
            values, ids = (t.tolist() for t in launched.host_logprobs)
            logprobs = logprob_entries(result, values, ids, [r.params for r in reqs])
        outputs = []
        for i, (r, tok, stop) in enumerate(zip(reqs[:committed], tokens, stops)):
            if result is not None:
                if i in result.raw_logits:
                    r.raw_logits.append(result.raw_logits[i])
                if r.params.output_scores:
                    r.scores.append(result.scores[i])
            outputs.append(self._emit(r, int(tok), stop, logprobs.get(i)))
        if error is not None:
            self._undelivered += outputs  # (the next step() returns them)
            raise error
        return outputs

    def _roll_back_launched(self, launched: "_LaunchedStep") -> None:
        """Roll back a launched step that cannot commit, with the step launched ahead on its requests."""
        self._ahead = None
        self._roll_back(launched.batch.requests + launched.requests, launched.generators)

    def _host_stop(self, r: Request, tokens: list[int], scores: torch.Tensor | None) -> tuple[str, str | None] | None:
        """Stop conditions checked on the host once ``tokens`` are appended to ``r``'s output
        (which is not changed: the commit's first phase): stop strings, the user's stopping
        criteria, max_time. Returns the finish reason and the stop string, or None (also when the
        last token finishes the request by itself: a stop token, ``max_new_tokens``)."""
        p = r.params
        if tokens[-1] in r.stop_ids or len(r.output) + len(tokens) >= p.max_new_tokens:
            return None
        if r.stop_criteria or p.stopping_criteria:
            ids = torch.tensor([r.prompt + r.output + tokens], dtype=torch.long)
            for text, criterion in r.stop_criteria:
                if bool(criterion(ids, None)[0]):
                    return "stop", text
            if p.stopping_criteria:
                dev_ids = ids.to(scores.device)
                for criterion in p.stopping_criteria:
                    if bool(torch.as_tensor(criterion(dev_ids, scores[None]))[0]):
                        return "stop", None
        if p.max_time is not None and time.perf_counter() - r.arrival_time > p.max_time:
            return "time", None
        return None

    def _emit(self, r: Request, token: int, stop: tuple[str, str | None] | None = None, logprobs=None) -> StepOutput:
        """Append a generated token to a request (``stop``: what :meth:`_host_stop` found for it);
        a finished request is handed to the scheduler. Runs no user code."""
        r.append_token(token)
        now = time.perf_counter()
        if r.first_token_time is None:
            r.first_token_time = now
        if logprobs is not None and r.logprobs is not None:
            r.logprobs.append(logprobs)
        if not r.is_finished and stop is not None:
            r.finish_reason, r.stop_str = stop
        c = self._counters
        c["generated_tokens"] += 1
        if r.is_finished:
            r.finish_time = now
            t = r.timings()
            self._timings.append((t["ttft"], t["tpot"]))
            self.scheduler.finish(r)
            self.sampler.release(r.rid)
            if self.speculative is not None:
                self.speculative.release(r.rid)
            c["requests_finished"] += 1
        return StepOutput(r.rid, token, r.is_finished, r.finish_reason, r.group, r.index, logprobs)

    def abort(self, rid: int) -> bool:
        """Stop a waiting or running request now (between steps: a step boundary). Its slots go
        back to the pools and its prefix-cache lock is released; it ends with finish reason
        ``"abort"`` and the output it had, and the next :meth:`step` returns its final
        :class:`StepOutput` (token None). Other requests are untouched. Returns False (changing
        nothing) when the request has already finished; an unknown id raises KeyError."""
        if rid not in self._requests:
            raise KeyError(f"no request {rid} (never added, or its result was already popped)")
        r = self._requests[rid]
        if r.is_finished:
            return False
        if self._ahead is not None and any(q is r for q in self._ahead.batch.requests):
            # a decode step is in flight for it (overlap): complete that step first, so its
            # other requests keep their tokens; they come with the next step()
            launched, self._ahead = self._ahead, None
            self._undelivered += self._finish(launched)
        for child in r.forks:  # n > 1: sequences waiting for its prefill are prefilled by themselves
            self.scheduler.add(child)
        r.forks = []
        self.scheduler.abort(r)
        r.finish_reason = "abort"
        r.finish_time = time.perf_counter()
        self.sampler.release(rid)
        if self.speculative is not None:
            self.speculative.release(rid)
        self._counters["requests_aborted"] += 1
        self._undelivered.append(StepOutput(rid, None, True, "abort", r.group, r.index))
        return True

    def _end_requests(self, rids: list[int]) -> None:
        """A generate call that raises ends the requests it added: aborted and forgotten."""
        for rid in rids:
            if rid in self._requests:
                self.abort(rid)
                self._requests.pop(rid)
        ended = set(rids)
        self._undelivered = [o for o in self._undelivered if o.rid not in ended]

    def pop_finished(self, rid: int) -> Request:
        req = self._requests[rid]
        if not req.is_finished:
            raise ValueError(f"request {rid} has not finished")
        return self._requests.pop(rid)

    # -- observability -------------------------------------------------------------------------
    def reset_timings(self) -> None:
        """Forget the finished requests' timings that ``stats()["ttft"]`` / ``["tpot"]`` summarise."""
        self._timings.clear()

    def pools_resized(self) -> None:
        """Elastic pools moved memory between the KV and Mamba pools: refresh the views kept (the
        scheduler's elastic pools call it after a move; under tensor parallelism the other ranks
        after taking rank 0's new sizes)."""
        self.runner.refresh_pool_views()
        self.runner.graphs.pools_resized(self.runner)
        if self.prefix_cache is not None:
            self.prefix_cache.pools_resized()
        if self.speculative is not None:
            self.speculative.pools_resized()

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
        c["fused_moe_modules"] = self.fused_experts  # experts modules on the fused path (EngineConfig.fused_moe)
        c["fused_moe_routers"] = self.fused_routers  # routers on moe_topk_softmax / _sigmoid_grouped (the same option)
        c["folded_shared_experts"] = self.folded_shared_experts  # MoE blocks serving their shared expert as a routed one
        c["quantization"] = dict(self.quantization)  # FP8 layers (EngineConfig.quantization, an FP8 checkpoint)
        c["startup"] = self.startup.as_dict()  # seconds per start-up phase (engine/startup.py)
        c["startup_work"] = self.startup.work_dict()  # ... and what each compiled
        # time to first token / per output token of the recently finished requests (seconds)
        c["ttft"] = _percentiles([t for t, _ in self._timings if t is not None])
        c["tpot"] = _percentiles([t for _, t in self._timings if t is not None])
        if self.speculative is not None:
            c["speculative"] = self.speculative.stats()
        if self.scheduler.elastic is not None:  # the current KV / Mamba split and the moves so far
            c["elastic_pools"] = self.scheduler.elastic.stats()
        if self.prefix_cache is not None:
            pc = {**self.prefix_cache.stats(), **self.scheduler.cache_counters}
            # prefix tokens served from the cache / tokens of the admitted requests
            pc["token_hit_rate"] = pc["admitted_hit_tokens"] / pc["admitted_tokens"] if pc["admitted_tokens"] else 0.0
            c["prefix_cache"] = pc
        return c

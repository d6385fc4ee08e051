"""The transformers-compatible API of :class:`~hybrid_compile.engine.HybridEngine`: ``generate``
(``model.generate``'s signature, settings and return types), ``generate_batch`` (prompts in,
new tokens or text out), text and chat prompts through the tokenizer, and the mapping of
transformers' generation settings to per-request :class:`SamplingParams`
(:mod:`.generation_config` decides what is honoured and what is refused).

:class:`GenerateAPI` is a mixin of ``HybridEngine``: everything here turns a call into requests
(``_add_requests``), drives :meth:`step` until they finish and shapes their tokens the way the
caller asked; the step machinery itself stays in :mod:`.engine`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from collections.abc import Mapping
from typing import Any, Iterable

import torch

from . import generation_config as gen_config
from .request import Request, StepOutput
from .request_front import RequestFront
from .request_front import is_messages as _is_messages
from .sampling import SamplingParams


def _per_request(base: SamplingParams, n: int) -> list[SamplingParams]:
    """One copy of ``base`` per prompt; sequence ``j`` of prompt ``i`` of a seeded call samples
    with seed + i * base.n + j (:meth:`HybridEngine._add_requests` numbers the sequences)."""
    return [
        dataclasses.replace(base, seed=None if base.seed is None else base.seed + i * base.n)
        for i in range(n)
    ]


def _refuse_dropped_outputs(plan: gen_config.GeneratePlan, call: str) -> None:
    """Settings that ask for an output ``call`` does not return raise (never computed, then dropped)."""
    if (plan.extra or {}).get("logprobs") is not None:
        raise ValueError(f"{call}: logprobs={plan.extra['logprobs']!r}: {call} returns tokens, not log-probabilities; "
                         "read them per token through add_request() / step() (StepOutput.logprobs, Request.logprobs)")
    if call == "generate_batch" and plan.return_dict:
        raise ValueError("generate_batch: return_dict_in_generate=True: generate_batch returns token lists; use "
                         "generate() for transformers' GenerateDecoderOnlyOutput (scores, logits)")


def _is_text(prompt: Any) -> bool:
    return isinstance(prompt, str) or _is_messages(prompt)


class GenerateAPI:
    """``generate`` / ``generate_batch`` / ``encode`` / ``decode`` of the engine (module docstring)."""

    @property
    def front(self) -> RequestFront:
        """This engine's tokenizer, generation defaults and limits: what planning and checking a
        request needs (:mod:`.request_front`; a server in another process gets a copy of it)."""
        return RequestFront(self.tokenizer, getattr(self.model, "generation_config", None), self.layout.vocab_size,
                            self.layout.max_position_embeddings, self.max_context_len, self.speculative is not None)

    def generate_settings(self, generation_config: Any = None, **kwargs) -> gen_config.GeneratePlan:
        """:meth:`generate`'s settings (keywords, ``generation_config``, the model's own generation
        config) merged and checked as transformers does; one it refuses raises ValueError naming it."""
        return self.front.settings(generation_config, **kwargs)

    def sampling_params(self, settings: gen_config.GeneratePlan, prompt_len: int) -> SamplingParams:
        """The :class:`SamplingParams` :meth:`generate` gives a prompt of ``prompt_len`` tokens under
        ``settings`` (:meth:`generate_settings`; the tokenizer's EOS when the settings name none)."""
        return self.front.sampling_params(settings, prompt_len)

    # -- transformers-like API ----------------------------------------------------------------
    def _plan(self, generation_config: Any = None, **kwargs) -> gen_config.GeneratePlan:
        return self.front.settings(generation_config, **kwargs)

    def _params_for(self, plan: gen_config.GeneratePlan, width: int) -> SamplingParams:
        return self.front.sampling_params(plan, width)

    def _run(self, rids: list[int], streamer: Any = None, prompt: torch.Tensor | None = None) -> list[Request]:
        """Step until every request of ``rids`` finishes; returns them (popped), in order. A
        transformers ``streamer`` (one sequence) gets ``prompt`` ``[1, L]``, each new token, then
        ``end()``. The steps' outputs for other requests (added by other callers, who drive
        :meth:`step`) are not this call's: the next :meth:`step` returns them, also when the call raises."""
        own, pending = set(rids), set(rids)
        others: list[StepOutput] = []
        outs: collections.deque = collections.deque()
        try:
            if streamer is not None:
                streamer.put(prompt)
            while pending:
                outs.extend(self.step())
                while outs:
                    out = outs.popleft()
                    if out.rid not in own:
                        others.append(out)
                        continue
                    if streamer is not None and out.token is not None and out.rid in pending:
                        streamer.put(torch.tensor([out.token]))
                    if out.finished:
                        pending.discard(out.rid)
            if streamer is not None:
                streamer.end()
        except BaseException:  # (a failed step, the streamer, Ctrl-C): the call's requests end with it
            self._undelivered = others + list(outs) + self._undelivered
            self._end_requests(rids)
            raise
        self._undelivered = others + self._undelivered
        return [self.pop_finished(rid) for rid in rids]

    # -- text -----------------------------------------------------------------------------------
    def encode(self, prompt: str | list[dict]) -> list[int]:
        """A string (tokenized as transformers does, special tokens added) or chat messages (the
        tokenizer's chat template with ``add_generation_prompt=True``) -> token ids."""
        return self.front.encode(prompt)

    def decode(self, tokens: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.front.decode(tokens, skip_special_tokens)

    @contextlib.contextmanager
    def _call_tokenizer(self, tokenizer: Any):
        """``tokenizer=`` of a generate / generate_batch call: the engine's tokenizer for the call
        (text prompts, stop strings, decoding), the engine's own again after it."""
        saved = self.tokenizer
        self.tokenizer = tokenizer
        try:
            yield
        finally:
            self.tokenizer = saved

    def generate_batch(self, prompts: list, skip_special_tokens: bool | None = None,
                       params: SamplingParams | list[SamplingParams] | None = None, streamer: Any = None,
                       tokenizer: Any = None, **sampling) -> list:
        """Generate for several prompts with continuous batching; returns the new tokens of
        each prompt, in order (with ``n > 1``: a list of the prompt's ``n`` sequences).

        Settings: ``params``, one :class:`SamplingParams` for every prompt (seeded: prompt ``i``
        samples with seed + i * n) or a list of one per prompt (used as they are); or keywords as
        :meth:`generate` takes them (transformers' generation settings, plus stop_token_ids, seed,
        ignore_eos, presence_penalty, frequency_penalty; ``max_length`` / ``min_length`` count each
        prompt's own length). Settings whose output a token list cannot carry (``logprobs``,
        ``return_dict_in_generate``) raise: :meth:`add_request` / :meth:`step` give log-probabilities.

        With a tokenizer, a prompt may also be a string or a chat conversation (a list of message
        dicts, rendered with the chat template and the generation prompt); its result is then the
        decoded text of its new tokens (``skip_special_tokens``, default True; refused when no
        prompt is text), not token ids. ``tokenizer``: used for this call instead of the engine's.
        ``streamer`` (a transformers streamer): one prompt with one sequence only, as in
        :meth:`generate`. ``attention_mask`` is refused (prompts are unpadded lists)."""
        if tokenizer is not None:
            with self._call_tokenizer(tokenizer):
                return self.generate_batch(prompts, skip_special_tokens, params, streamer, **sampling)
        if isinstance(prompts, str) or _is_messages(prompts):
            raise TypeError("generate_batch takes a list of prompts; for one prompt use generate()")
        if sampling.get("attention_mask") is not None:
            raise ValueError("generate_batch: attention_mask has no meaning here: each prompt is its own unpadded "
                             "token list (or text); for a padded [batch, length] tensor use generate(input_ids, "
                             "attention_mask=...)")
        sampling.pop("attention_mask", None)
        prompts = list(prompts)
        is_text = [_is_text(p) for p in prompts]
        if skip_special_tokens is not None and not any(is_text):
            raise ValueError("generate_batch: skip_special_tokens applies to text prompts (their results are decoded "
                             "text); these prompts are token ids and their results are token ids")
        prompts = [self.encode(p) if t else list(p) for p, t in zip(prompts, is_text)]
        if params is not None:
            if sampling:
                raise ValueError(f"generate_batch: pass either params= or generation keywords, not both "
                                 f"(got {', '.join(sorted(sampling))})")
            if isinstance(params, SamplingParams):
                per_prompt = _per_request(params, len(prompts))
            else:
                per_prompt = list(params)
                if len(per_prompt) != len(prompts) or not all(isinstance(p, SamplingParams) for p in per_prompt):
                    raise ValueError(f"generate_batch: params must be one SamplingParams or a list of one per prompt "
                                     f"({len(prompts)}), got {len(per_prompt)}")
        else:
            plan = self._plan(**sampling)
            _refuse_dropped_outputs(plan, "generate_batch")
            per_prompt = [dataclasses.replace(self._params_for(plan, len(p)), seed=None) for p in prompts]
            seed = (plan.extra or {}).get("seed")
            for i, p in enumerate(per_prompt):
                p.seed = None if seed is None else seed + i * p.n
        if streamer is not None and (len(prompts) != 1 or per_prompt[0].n != 1):
            raise ValueError("generate_batch: streamer supports one sequence only (one prompt, n = 1), as "
                             "transformers' streamers do")
        rids = self._add_requests(prompts, per_prompt)
        done = self._run(rids, streamer, None if streamer is None else torch.tensor(prompts, dtype=torch.long))
        skip = True if skip_special_tokens is None else skip_special_tokens
        results, at = [], 0
        for p, t in zip(per_prompt, is_text):
            outs = [self.decode(r.output, skip) if t else r.output for r in done[at: at + p.n]]
            at += p.n
            results.append(outs[0] if p.n == 1 else outs)
        return results

    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        generation_config: Any = None,
        streamer: Any = None,
        pad_token_id: int | None = None,
        **kwargs,
    ) -> Any:
        """Like ``model.generate``: ``input_ids [B, L]`` (left-padded rows with
        ``attention_mask``) -> ``[B * num_return_sequences, L + new]``; rows that stop early are
        padded with the pad token (or EOS). ``streamer`` (a transformers streamer) needs one
        sequence. Every transformers generation setting is honoured or refused with a ValueError
        naming it (engine/generation_config.py lists them), whether it comes as a keyword, in
        ``generation_config`` or from the model's own generation config. With
        ``return_dict_in_generate=True`` the result is transformers' ``GenerateDecoderOnlyOutput``
        (``sequences``; ``scores`` / ``logits`` with ``output_scores`` / ``output_logits``, one
        ``[B * n, V]`` tensor per step; rows of sequences that already finished hold -inf there).

        With a tokenizer, ``input_ids`` may instead be text: a string or a chat conversation (list
        of message dicts) -> the generated text (``skip_special_tokens=True`` by default); a list
        of them -> a list of texts (through :meth:`generate_batch`). ``tokenizer``: used for this
        call instead of the engine's (stop strings, text)."""
        tokenizer = kwargs.pop("tokenizer", None)
        if tokenizer is not None:
            with self._call_tokenizer(tokenizer):
                return self.generate(input_ids, attention_mask, generation_config, streamer, pad_token_id, **kwargs)
        if _is_text(input_ids) or (
            isinstance(input_ids, (list, tuple)) and input_ids and all(_is_text(p) for p in input_ids)
        ):
            return self._generate_text(input_ids, attention_mask, generation_config, streamer,
                                       pad_token_id=pad_token_id, **kwargs)
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, length], got shape {tuple(input_ids.shape)}")
        if kwargs.get("skip_special_tokens") is not None:
            raise ValueError("generate(): skip_special_tokens applies to text prompts (the result is decoded text); "
                             "with token ids generate() returns token ids")
        kwargs.pop("skip_special_tokens", None)
        plan = self._plan(generation_config, pad_token_id=pad_token_id, **kwargs)
        _refuse_dropped_outputs(plan, "generate()")
        params = self._params_for(plan, input_ids.shape[1])
        rows = input_ids.tolist()
        if attention_mask is not None:
            if attention_mask.shape != input_ids.shape:
                raise ValueError("attention_mask must have the shape of input_ids")
            mask = attention_mask.bool().tolist()
            prompts = [[t for t, m in zip(row, mrow) if m] for row, mrow in zip(rows, mask)]
        else:
            prompts = rows
        if streamer is not None and len(prompts) * params.n != 1:
            raise ValueError("streaming supports one sequence only (batch size 1, num_return_sequences 1), as in "
                             "transformers")
        rids = self._add_requests(prompts, _per_request(params, len(prompts)))
        done = self._run(rids, streamer, input_ids.cpu())
        pad = plan.values.get("pad_token_id")
        if pad is None:
            pad = params.eos_token_ids[0] if params.eos_token_ids else 0
        width = max(len(r.output) for r in done)
        new = torch.full((len(done), width), int(pad), dtype=torch.long)
        for i, r in enumerate(done):
            new[i, : len(r.output)] = torch.tensor(r.output, dtype=torch.long)
        prompt_rows = input_ids.cpu().long().repeat_interleave(params.n, dim=0)
        sequences = torch.cat([prompt_rows, new], dim=1).to(input_ids.device)
        if not plan.return_dict:
            return sequences
        from transformers.generation.utils import GenerateDecoderOnlyOutput

        def per_step(rows_of):
            if not any(rows_of(r) for r in done):
                return None
            vocab = next(rows_of(r)[0] for r in done if rows_of(r)).shape[0]
            filler = torch.full((vocab,), float("-inf"), device=input_ids.device)
            return tuple(torch.stack([rows_of(r)[t].to(input_ids.device) if t < len(rows_of(r)) else filler
                                      for r in done]) for t in range(width))

        return GenerateDecoderOnlyOutput(
            sequences=sequences,
            scores=per_step(lambda r: r.scores) if params.output_scores else None,
            logits=per_step(lambda r: r.raw_logits) if params.output_logits else None,
        )

    def _generate_text(self, prompts, attention_mask, generation_config, streamer, skip_special_tokens=True, **kw):
        if attention_mask is not None:
            raise ValueError("attention_mask goes with token ids; text prompts are tokenized by the engine")
        if kw.get("pad_token_id") is None:
            kw.pop("pad_token_id", None)
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
        if isinstance(out, torch.Tensor) and out.shape[0] == 1:
            return self.decode(out[0, len(ids):].tolist(), skip_special_tokens)
        sequences = out if isinstance(out, torch.Tensor) else out.sequences
        texts = [self.decode(row[len(ids):].tolist(), skip_special_tokens) for row in sequences]
        return texts if isinstance(out, torch.Tensor) else out

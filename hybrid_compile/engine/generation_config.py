"""transformers' generation settings -> :class:`~.sampling.SamplingParams`: every setting honoured
or refused, none ignored.

``generate()`` takes its settings as transformers does: keyword arguments over a
``GenerationConfig`` (its fields that differ from a fresh ``GenerationConfig()``) over the model's
own ``generation_config`` (e.g. the checkpoint's ``generation_config.json``) over transformers'
global defaults. Every public field of ``GenerationConfig`` is in exactly one of three tables:

- :data:`HONOURED`: turned into ``SamplingParams`` fields or output options, with transformers'
  meaning (``max_length`` counts the prompt, ``min_length`` too, ...);
- :data:`NO_EFFECT`: settings that do not change what transformers' ``generate`` returns for a
  decoder-only model with these inputs either (KV-cache implementation, compile options, encoder-
  decoder-only and beam-search-only settings with one beam, ...): accepted, nothing to do;
- :data:`REFUSED`: generation modes the engine does not run (beam search, contrastive search,
  classifier-free guidance, ...): a value other than the neutral one raises one ``ValueError``
  naming the field, before any work starts.

A field none of the tables knows (a newer transformers) raises too. The same goes for
``generate()``'s own arguments (:data:`HONOURED_ARGUMENTS`, :data:`REFUSED_ARGUMENTS`).
"""

from __future__ import annotations

import functools

from dataclasses import dataclass
from typing import Any

from .sampling import SamplingParams

HONOURED = {
    "max_length": "prompt + new tokens (transformers' meaning); max_new_tokens takes precedence",
    "max_new_tokens": "new tokens",
    "min_length": "no stop token before prompt + new tokens reach it",
    "min_new_tokens": "no stop token before this many new tokens (SamplingParams.min_tokens)",
    "max_time": "a sequence stops after this many seconds",
    "stop_strings": "stop after the token that completes one of them (needs a tokenizer)",
    "do_sample": "sample (else greedy)",
    "num_beams": "1 only: beam search is refused",
    "temperature": "sampling temperature",
    "top_k": "top-k filter when sampling",
    "top_p": "nucleus filter when sampling",
    "min_p": "min-p filter when sampling",
    "typical_p": "typical filter when sampling",
    "epsilon_cutoff": "epsilon filter when sampling",
    "eta_cutoff": "eta filter when sampling",
    "repetition_penalty": "transformers' repetition penalty (prompt and generated tokens)",
    "no_repeat_ngram_size": "n-grams never repeat",
    "encoder_repetition_penalty": "the prompt's tokens favoured (> 1) or penalised (< 1): transformers applies it to a "
                                  "decoder-only model with the prompt as encoder input (here each request's own "
                                  "prompt: a left-padded row's pad tokens are not part of it)",
    "encoder_no_repeat_ngram_size": "n-grams of the prompt never generated (transformers: with the prompt as encoder "
                                    "input; here each request's own prompt)",
    "bad_words_ids": "token sequences never generated",
    "sequence_bias": "bias of token sequences",
    "renormalize_logits": "log-softmax of the processed scores",
    "forced_bos_token_id": "first token forced (one-token prompts, as transformers)",
    "forced_eos_token_id": "last token forced to EOS when max_length is reached",
    "remove_invalid_values": "nan / inf in the scores replaced",
    "exponential_decay_length_penalty": "EOS score grows after a start index",
    "suppress_tokens": "tokens never generated",
    "begin_suppress_tokens": "tokens not generated first",
    "num_return_sequences": "sequences per prompt (SamplingParams.n; the prompt is prefilled once)",
    "output_scores": "processed scores per step (with return_dict_in_generate)",
    "output_logits": "raw logits per step (with return_dict_in_generate)",
    "return_dict_in_generate": "a GenerateDecoderOnlyOutput",
    "pad_token_id": "pads rows that stop early",
    "eos_token_id": "stop tokens (an int or a list)",
}
NO_EFFECT = {
    "use_cache": "the engine always keeps its KV and recurrent state in its pools (same tokens)",
    "cache_implementation": "transformers' KV-cache class; the engine has its own pools (same tokens)",
    "cache_config": "transformers' KV-cache class options (same tokens)",
    "max_cache_len": "transformers' static-cache length (same tokens)",
    "compile_config": "transformers' compile options; the engine compiles per EngineConfig.compile",
    "disable_compile": "transformers' compile switch; the engine compiles per EngineConfig.compile",
    "continuous_batching_config": "transformers' own continuous batching; the engine batches by itself",
    "prefill_chunk_size": "transformers' chunked prefill; EngineConfig.chunked_prefill_size (same tokens)",
    "low_memory": "beam / contrastive search only",
    "early_stopping": "beam search only (num_beams is 1)",
    "length_penalty": "beam search only (num_beams is 1)",
    "bos_token_id": "used by transformers only when generate() gets no input ids",
    "decoder_start_token_id": "encoder-decoder models only",
    "is_assistant": "marks an assistant model's config",
    "num_assistant_tokens": "assisted generation only (refused: assistant_model / prompt_lookup_num_tokens)",
    "num_assistant_tokens_schedule": "assisted generation only",
    "assistant_confidence_threshold": "assisted generation only",
    "max_matching_ngram_size": "prompt-lookup generation only (prompt_lookup_num_tokens is refused)",
    "assistant_lookbehind": "assisted generation with a different tokenizer only",
    "target_lookbehind": "assisted generation with a different tokenizer only",
    "assistant_ensemble_weight": "assisted generation only",
    "transformers_version": "metadata",
}
# field -> (why refused, the values that leave it off)
REFUSED = {
    "guidance_scale": ("classifier-free guidance (a second, negative-prompt forward) is not supported", (None, 1, 1.0)),
    "watermarking_config": ("watermarking is not supported", (None,)),
    "token_healing": ("token healing is not supported", (None, False)),
    "top_h": ("top-H sampling is not supported", (None,)),
    "use_mtp": ("multi-token-prediction decoding is not supported", (None, False)),
    "penalty_alpha": ("contrastive search is not supported", (None, 0, 0.0)),
    "dola_layers": ("DoLa decoding is not supported", (None,)),
    "diversity_penalty": ("group beam search is not supported", (None, 0, 0.0)),
    "num_beam_groups": ("group beam search is not supported", (None, 1)),
    "constraints": ("constrained beam search is not supported", (None,)),
    "force_words_ids": ("constrained beam search is not supported", (None,)),
    "output_attentions": ("attention weights are not returned (the engine's attention kernels never form them)",
                          (None, False)),
    "output_hidden_states": ("hidden states are not returned", (None, False)),
    "prompt_lookup_num_tokens": ("prompt-lookup decoding through generate() is not supported; configure "
                                 "EngineConfig.speculative (method 'ngram') instead", (None,)),
    "assistant_early_exit": ("self-speculative decoding is not supported; configure EngineConfig.speculative",
                             (None,)),
    "speculation_type": ("transformers' speculative modes are not supported; configure EngineConfig.speculative",
                         (None,)),
}
# generate() keyword arguments that are not GenerationConfig fields
HONOURED_ARGUMENTS = {"logits_processor", "stopping_criteria", "tokenizer", "streamer", "attention_mask",
                      "generation_config", "stop_token_ids", "seed", "ignore_eos", "logprobs", "presence_penalty",
                      "frequency_penalty", "skip_special_tokens"}
NO_EFFECT_ARGUMENTS = {"synced_gpus": "one process serves the request"}
REFUSED_ARGUMENTS = {
    "assistant_model": "assisted generation through generate() is not supported; configure EngineConfig.speculative",
    "assistant_tokenizer": "assisted generation through generate() is not supported",
    "prefix_allowed_tokens_fn": "prefix-constrained generation is not supported; pass a logits_processor",
    "negative_prompt_ids": "classifier-free guidance is not supported",
    "negative_prompt_attention_mask": "classifier-free guidance is not supported",
    "custom_generate": "custom generation methods are not supported",
}


def config_fields() -> list[str]:
    """The public fields of transformers' ``GenerationConfig`` (from the class itself)."""
    from transformers import GenerationConfig

    return sorted(k for k in vars(GenerationConfig()) if not k.startswith("_"))


def _defaults() -> tuple[dict[str, Any], dict[str, Any]]:
    """Each field's unset value (a fresh ``GenerationConfig()``) and what transformers fills in
    for an unset one (``_get_default_generation_params``, where the version has it): copies of
    :func:`_default_values` (built once: a ``GenerationConfig()`` per request cost the server
    ~10 % of its per-request time)."""
    fresh, fill = _default_values()
    return dict(fresh), dict(fill)


@functools.lru_cache(maxsize=1)
def _default_values() -> tuple[dict[str, Any], dict[str, Any]]:
    from transformers import GenerationConfig

    fresh = {k: v for k, v in vars(GenerationConfig()).items() if not k.startswith("_")}
    fill = dict(fresh)
    getter = getattr(GenerationConfig, "_get_default_generation_params", None)
    if getter is not None:
        fill.update({k: v for k, v in getter().items() if k in fill and fill[k] is None})
    return fresh, fill


@dataclass
class GeneratePlan:
    """A ``generate()`` call's settings, resolved: the values of every field and the output options.
    :meth:`params` gives one prompt's :class:`SamplingParams`."""

    values: dict[str, Any]
    explicit_max_length: bool  # max_length set somewhere (else transformers' default 20 new tokens)
    logits_processors: tuple = ()
    stopping_criteria: tuple = ()
    extra: dict | None = None  # engine arguments: stop_token_ids, seed, ignore_eos, logprobs, penalties

    @property
    def return_dict(self) -> bool:
        return bool(self.values.get("return_dict_in_generate"))

    @property
    def n(self) -> int:
        return int(self.values.get("num_return_sequences") or 1)

    def params(self, width: int, max_positions: int | None = None) -> SamplingParams:
        """One prompt's SamplingParams; ``width``: its length as transformers counts it (a padded
        batch: the padded width)."""
        v, x = self.values, self.extra or {}
        if v.get("max_new_tokens") is not None:
            max_new = int(v["max_new_tokens"])
        elif self.explicit_max_length:
            max_new = int(v["max_length"]) - width
            if max_new <= 0:
                raise ValueError(f"generate(): max_length={v['max_length']} leaves no room for new tokens after the "
                                 f"{width}-token prompt (max_length counts the prompt; use max_new_tokens)")
        else:
            total = int(v.get("max_length") or 20) + width
            if max_positions is not None:
                total = min(total, max_positions)
            max_new = max(1, total - width)
        if v.get("min_new_tokens") is not None:
            min_tokens = int(v["min_new_tokens"])
        else:
            min_tokens = max(0, int(v.get("min_length") or 0) - width)
        eos = v.get("eos_token_id")
        eos = () if eos is None else (int(eos),) if isinstance(eos, int) else tuple(int(e) for e in eos)
        forced_eos = v.get("forced_eos_token_id")
        forced_eos = () if forced_eos is None else (int(forced_eos),) if isinstance(forced_eos, int) \
            else tuple(int(e) for e in forced_eos)
        stop = v.get("stop_strings")
        stop = () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)
        bias = v.get("sequence_bias")
        if isinstance(bias, dict):
            bias = [[list(k), b] for k, b in bias.items()]
        decay = v.get("exponential_decay_length_penalty")
        do_sample = bool(v.get("do_sample"))
        return SamplingParams(
            max_new_tokens=max_new,
            do_sample=do_sample,
            temperature=float(v.get("temperature") if v.get("temperature") is not None else 1.0),
            top_k=int(v.get("top_k") or 0),
            top_p=float(v.get("top_p") if v.get("top_p") is not None else 1.0),
            min_p=float(v.get("min_p") or 0.0),
            typical_p=float(v.get("typical_p") if v.get("typical_p") is not None else 1.0),
            epsilon_cutoff=float(v.get("epsilon_cutoff") or 0.0),
            eta_cutoff=float(v.get("eta_cutoff") or 0.0),
            repetition_penalty=float(v.get("repetition_penalty") or 1.0),
            no_repeat_ngram_size=int(v.get("no_repeat_ngram_size") or 0),
            encoder_repetition_penalty=float(v.get("encoder_repetition_penalty") or 1.0),
            encoder_no_repeat_ngram_size=int(v.get("encoder_no_repeat_ngram_size") or 0),
            bad_words_ids=tuple(tuple(int(t) for t in w) for w in (v.get("bad_words_ids") or ())),
            sequence_bias=tuple((tuple(int(t) for t in s), float(b)) for s, b in (bias or ())),
            suppress_tokens=tuple(int(t) for t in (v.get("suppress_tokens") or ())),
            begin_suppress_tokens=tuple(int(t) for t in (v.get("begin_suppress_tokens") or ())),
            forced_bos_token_id=None if v.get("forced_bos_token_id") is None else int(v["forced_bos_token_id"]),
            forced_eos_token_ids=forced_eos,
            remove_invalid_values=bool(v.get("remove_invalid_values")),
            renormalize_logits=bool(v.get("renormalize_logits")),
            exponential_decay_length_penalty=None if decay is None else (int(decay[0]), float(decay[1])),
            max_time=None if v.get("max_time") is None else float(v["max_time"]),
            min_tokens=min_tokens,
            eos_token_ids=eos,
            stop=stop,
            n=self.n,
            output_scores=bool(v.get("output_scores")) and self.return_dict,
            output_logits=bool(v.get("output_logits")) and self.return_dict,
            logits_processors=self.logits_processors,
            stopping_criteria=self.stopping_criteria,
            stop_token_ids=tuple(int(t) for t in (x.get("stop_token_ids") or ())),
            seed=x.get("seed"),
            ignore_eos=bool(x.get("ignore_eos", False)),
            logprobs=x.get("logprobs"),
            presence_penalty=float(x.get("presence_penalty") or 0.0),
            frequency_penalty=float(x.get("frequency_penalty") or 0.0),
        )


def resolve(model_config: Any, generation_config: Any, kwargs: dict[str, Any]) -> GeneratePlan:
    """Merge the settings as transformers does and check every one (module docstring); raises
    ValueError naming the first refused or unknown setting."""
    fresh, fill = _defaults()
    fields = set(fresh)
    unknown_fields = sorted(fields - set(HONOURED) - set(NO_EFFECT) - set(REFUSED))
    engine_args = {"stop_token_ids", "seed", "ignore_eos", "logprobs", "presence_penalty", "frequency_penalty"}
    extra = {k: kwargs[k] for k in engine_args if kwargs.get(k) is not None}
    processors = kwargs.get("logits_processor") or ()
    criteria = kwargs.get("stopping_criteria") or ()
    for name, why in REFUSED_ARGUMENTS.items():
        if kwargs.get(name) is not None:
            raise ValueError(f"generate(): {name} is not supported: {why}")
    known_args = HONOURED_ARGUMENTS | set(NO_EFFECT_ARGUMENTS) | set(REFUSED_ARGUMENTS)
    unknown = sorted(k for k in kwargs if k not in fields and k not in known_args)
    if unknown:
        raise ValueError(f"generate(): unsupported argument(s): {', '.join(unknown)} (neither a GenerationConfig field "
                         "nor a generate() argument the engine knows)")

    def is_set(cfg, k):
        if cfg is None or not hasattr(cfg, k):
            return False
        value = getattr(cfg, k)
        return value is not None and value != fresh[k]

    values: dict[str, Any] = {}
    source: dict[str, str] = {}
    for k in sorted(fields):
        if k in kwargs and kwargs[k] is not None:
            values[k], source[k] = kwargs[k], "argument"
        elif is_set(generation_config, k):
            values[k], source[k] = getattr(generation_config, k), "generation_config"
        elif is_set(model_config, k):
            values[k], source[k] = getattr(model_config, k), "the model's generation_config"
        else:
            values[k] = fill[k]
    for k in unknown_fields:
        if values.get(k) not in (None, fill[k]) and source.get(k):
            raise ValueError(f"generate(): {k}={values[k]!r} (from {source[k]}) is a GenerationConfig setting this "
                             "engine does not know; it is refused rather than ignored")
    for k, (why, off) in REFUSED.items():
        if k in values and source.get(k) and values[k] not in off and values[k] != fill.get(k):
            raise ValueError(f"generate(): {k}={values[k]!r} (from {source[k]}): {why}")
    if (values.get("num_beams") or 1) != 1:
        raise ValueError(f"generate(): num_beams={values['num_beams']} (from {source.get('num_beams', 'defaults')}): "
                         "beam search is not supported")
    if (values.get("num_return_sequences") or 1) > 1 and not values.get("do_sample"):
        # transformers' GenerationConfig.validate: greedy decoding gives one sequence per prompt
        raise ValueError(f"generate(): num_return_sequences={values['num_return_sequences']} (from "
                         f"{source.get('num_return_sequences')}) with greedy decoding (do_sample=False): greedy "
                         "methods without beam search do not support num_return_sequences different than 1, as in "
                         "transformers; sample (do_sample=True), or pass SamplingParams(n=...) for copies of the "
                         "greedy sequence")
    explicit_max_length = "max_length" in source
    if callable(processors) and not isinstance(processors, (list, tuple)):
        processors = (processors,)
    if callable(criteria) and not isinstance(criteria, (list, tuple)):
        criteria = (criteria,)
    return GeneratePlan(values, explicit_max_length, tuple(processors), tuple(criteria), extra)

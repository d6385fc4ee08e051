"""What a request needs before it reaches the engine's step loop, without the model: the
tokenizer (text and chat prompts), the model's generation config (``generate()``'s defaults and
EOS), and the engine's fixed limits (vocabulary, maximum context length, speculative decoding).

:class:`RequestFront` turns ``generate()``'s settings into :class:`SamplingParams` and checks a
request as ``add_request`` would. The engine itself goes through it (``HybridEngine.front``), and
so does a server whose engine runs in another process (``serving/engine_process.py``): the child
sends its engine's front once loaded, and the server tokenizes, plans and validates requests with
it while the child only steps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Iterable

from . import generation_config as gen_config
from .sampling import SamplingParams


def out_of_vocabulary(prompt: list[int], vocab_size: int) -> list[int]:
    """The token ids of ``prompt`` outside ``[0, vocab_size)`` (min / max first: a prompt of
    thousands of tokens is checked without a Python loop over them)."""
    if not prompt or (min(prompt) >= 0 and max(prompt) < vocab_size):
        return []
    return [t for t in prompt if not 0 <= t < vocab_size]


def is_messages(prompt: Any) -> bool:
    """A chat conversation: a non-empty list of message dicts (``{"role": ..., "content": ...}``)."""
    return isinstance(prompt, (list, tuple)) and len(prompt) > 0 and all(isinstance(m, Mapping) for m in prompt)


@dataclass
class RequestFront:
    """An engine's tokenizer, generation defaults and limits (picklable, with a picklable tokenizer)."""

    tokenizer: Any  # a transformers tokenizer, or None (token ids only)
    generation_config: Any  # the model's transformers GenerationConfig, or None
    vocab_size: int
    max_position_embeddings: int
    max_context_len: int  # the model's limit, EngineConfig.max_context_len or the KV pool, whichever is smallest
    speculative: bool  # EngineConfig.speculative is set: requests sample with basic settings only

    # -- settings -> SamplingParams ---------------------------------------------------------------
    def settings(self, generation_config: Any = None, **kwargs) -> gen_config.GeneratePlan:
        """``generate()``'s settings (keywords, ``generation_config``, the model's own generation
        config) merged and checked as transformers does; one it refuses raises ValueError naming it."""
        return gen_config.resolve(self.generation_config, generation_config, kwargs)

    def sampling_params(self, settings: gen_config.GeneratePlan, prompt_len: int) -> SamplingParams:
        """The SamplingParams ``generate()`` gives a prompt of ``prompt_len`` tokens under
        ``settings`` (the tokenizer's EOS when the settings name none)."""
        params = settings.params(prompt_len, self.max_position_embeddings)
        if not params.eos_token_ids and settings.values.get("eos_token_id") is None \
                and getattr(self.tokenizer, "eos_token_id", None) is not None:
            # the generation config names no EOS: the tokenizer's
            params = dataclasses.replace(params, eos_token_ids=(int(self.tokenizer.eos_token_id),))
        return params

    # -- checks -----------------------------------------------------------------------------------
    def check_params(self, index: int, p: SamplingParams) -> None:
        p.validate(self.vocab_size)
        if p.stop and self.tokenizer is None:
            raise ValueError(f"prompt {index}: SamplingParams.stop (stop strings) needs a tokenizer: pass tokenizer= "
                             "to wrap() / from_pretrained() or set engine.tokenizer")
        basic = not dataclasses.replace(p, do_sample=False).needs_processing and not (
            p.do_sample and (p.min_p > 0 or p.typical_p < 1 or p.epsilon_cutoff > 0 or p.eta_cutoff > 0))
        if self.speculative and not basic:
            raise ValueError(f"prompt {index}: with speculative decoding (EngineConfig.speculative) a request samples "
                             "with temperature / top_k / top_p only; penalties, logits processors, min_p, min_tokens, "
                             "logprobs, scores and stop strings need an engine without speculative decoding")

    def check_prompt(self, index: int, prompt: list[int], params: SamplingParams) -> None:
        if len(prompt) == 0:
            raise ValueError(f"prompt {index} is empty")
        vocab = self.vocab_size
        bad = out_of_vocabulary(prompt, vocab)
        if bad:
            raise ValueError(f"prompt {index} has token id(s) outside the vocabulary [0, {vocab}): {bad[:5]}")
        # max_context_len never exceeds the KV pool's capacity, so this also rejects a request
        # that could never fit in the pool
        need = len(prompt) + params.max_new_tokens
        if need > self.max_context_len:
            raise ValueError(
                f"prompt {index} ({len(prompt)} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds the "
                f"maximum context length {self.max_context_len} (the model's limit, max_context_len, or the KV "
                "pool's capacity max_total_tokens, whichever is smallest)"
            )

    def validate_request(self, prompt: Iterable[int], params: SamplingParams | None = None) -> None:
        """Raise ValueError for a request ``add_request`` would refuse (bad sampling values, an empty
        prompt, token ids outside the vocabulary, prompt + max_new_tokens over the context)."""
        params = params or SamplingParams()
        self.check_params(0, params)
        self.check_prompt(0, [int(t) for t in prompt], params)

    # -- text -------------------------------------------------------------------------------------
    def require_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise ValueError(
                "text input needs a tokenizer and this engine has none: pass tokenizer= to wrap() or "
                "from_pretrained(), set engine.tokenizer = AutoTokenizer.from_pretrained(...), or pass token ids"
            )
        return self.tokenizer

    def encode(self, prompt: str | list[dict]) -> list[int]:
        """A string (tokenized as transformers does, special tokens added) or chat messages (the
        tokenizer's chat template with ``add_generation_prompt=True``) -> token ids."""
        tok = self.require_tokenizer()
        if isinstance(prompt, str):
            return [int(t) for t in tok(prompt)["input_ids"]]
        if not is_messages(prompt):
            raise TypeError(f"expected a string or a list of chat message dicts, got {type(prompt).__name__}")
        text = tok.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=False)
        return [int(t) for t in tok(text, add_special_tokens=False)["input_ids"]]

    def decode(self, tokens: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.require_tokenizer().decode(list(tokens), skip_special_tokens=skip_special_tokens)

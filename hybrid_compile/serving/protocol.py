"""OpenAI's API shapes: request fields parsed and checked, mapped onto the engine's SamplingParams,
and error bodies.

Requests are pydantic models that forbid unknown fields: a field this server does not know is a
400 naming it (never silently ignored), as are known fields whose value it cannot honour (e.g.
``logit_bias``). Error bodies are OpenAI's: ``{"error": {"message", "type", "param", "code"}}``.
Besides OpenAI's own fields the sampling extensions that vLLM and SGLang accept are taken too
(``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``,
``stop_token_ids``, ``skip_special_tokens``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, ValidationError

from ..engine import SamplingParams


class OpenAIError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code
        self.type = type or {400: "invalid_request_error", 404: "invalid_request_error",
                             503: "service_unavailable_error"}.get(status, "internal_server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# -- request models ---------------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingRequest(_Strict):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    user: str | None = None  # an end-user id: no effect on the output
    # extensions of vLLM / SGLang
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True


class CompletionRequest(_SamplingRequest):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class _TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[_TextPart], None] = None
    name: str | None = None

    def as_template_message(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


def parse_request(model_cls: type[_Strict], body: Any) -> Any:
    """Validate a decoded JSON body; the first problem becomes a 400 naming its field."""
    if not isinstance(body, dict):
        raise OpenAIError("the request body must be a JSON object", param=None)
    try:
        return model_cls.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        loc = [str(x) for x in err["loc"] if not _is_union_branch(x)]
        param = _param_name(loc)
        if err["type"] == "extra_forbidden":
            raise OpenAIError(f"Unrecognized request argument supplied: {param}", param=param) from None
        if err["type"] == "missing":
            raise OpenAIError(f"Missing required parameter: '{param}'.", param=param) from None
        raise OpenAIError(f"Invalid value for '{param}': {err['msg']}", param=param) from None


def _is_union_branch(part: Any) -> bool:
    # pydantic names the union member it tried (``str``, ``list[int]``, ``_TextPart``) in the location
    return isinstance(part, str) and (part[:1].isupper() or "[" in part or part in ("str", "int", "float"))


def _param_name(loc: list[str]) -> str:
    name = ""
    for part in loc:
        name += f"[{part}]" if part.isdigit() else (f".{part}" if name else part)
    return name


# -- sampling ---------------------------------------------------------------------------------------


def engine_has(name: str) -> bool:
    return name in {f.name for f in dataclasses.fields(SamplingParams)}


def sampling_fields(req: _SamplingRequest, max_tokens: int, logprobs: int | None) -> tuple[dict, dict]:
    """OpenAI's sampling fields -> (keyword arguments of ``generate``'s sampling: ``max_new_tokens``,
    ``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``seed``, ``ignore_eos``,
    ``stop_token_ids``; further SamplingParams fields set on top of those). A field with a value
    the engine cannot honour is a 400 naming it."""
    fields: dict[str, Any] = dict(max_new_tokens=max_tokens, seed=req.seed, ignore_eos=req.ignore_eos)
    more: dict[str, Any] = {}
    temperature = 1.0 if req.temperature is None else req.temperature
    if not temperature >= 0:
        raise OpenAIError(f"temperature must be >= 0, got {temperature}", param="temperature")
    top_p = 1.0 if req.top_p is None else req.top_p
    if not 0.0 < top_p <= 1.0:
        raise OpenAIError(f"top_p must be in (0, 1], got {top_p}", param="top_p")
    top_k = req.top_k if req.top_k not in (None, -1) else 0
    if top_k < 0:
        raise OpenAIError(f"top_k must be -1 (off), 0 (off) or positive, got {req.top_k}", param="top_k")
    if temperature == 0:  # greedy, as OpenAI's and vLLM's temperature 0
        fields.update(do_sample=False)
    else:
        fields.update(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k)
    if req.stop_token_ids:
        fields["stop_token_ids"] = tuple(int(t) for t in req.stop_token_ids)
    if req.logit_bias:
        raise OpenAIError("logit_bias is not supported by this server", param="logit_bias")
    # fields the engine's SamplingParams may or may not have (see engine_has)
    for name, value, neutral, check in (
        ("min_p", req.min_p, 0.0, lambda v: 0.0 <= v <= 1.0),
        ("presence_penalty", req.presence_penalty, 0.0, lambda v: -2.0 <= v <= 2.0),
        ("frequency_penalty", req.frequency_penalty, 0.0, lambda v: -2.0 <= v <= 2.0),
        ("repetition_penalty", req.repetition_penalty, 1.0, lambda v: v > 0),
        ("min_tokens", req.min_tokens, 0, lambda v: 0 <= v <= max_tokens),
    ):
        if value is None or value == neutral:
            continue
        if not check(value):
            raise OpenAIError(f"{name}={value} is out of range", param=name)
        if not engine_has(name):
            raise OpenAIError(f"{name} is not supported by this server's engine yet", param=name)
        more[name] = value
    if logprobs is not None:
        if not engine_has("logprobs"):
            raise OpenAIError("logprobs are not supported by this server's engine yet", param="logprobs")
        more["logprobs"] = logprobs
    return fields, more


def stop_strings(req: _SamplingRequest) -> list[str]:
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > 4:
        raise OpenAIError("stop takes at most 4 sequences", param="stop")
    if any(not s for s in stop):
        raise OpenAIError("stop sequences must not be empty", param="stop")
    return stop


def check_n(req: _SamplingRequest) -> int:
    if not 1 <= req.n <= 128:
        raise OpenAIError(f"n must be between 1 and 128, got {req.n}", param="n")
    return req.n


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}


# -- logprobs ---------------------------------------------------------------------------------------


def _token_text(tokenizer, token: int) -> str:
    return tokenizer.decode([token], skip_special_tokens=False)


def completion_logprobs(tokenizer, token_ids: list[int], entries: list, text_offset: int) -> tuple[dict, int]:
    """OpenAI's completions ``logprobs`` object for generated tokens, and the text offset after
    them; ``entries[i]`` is the engine's ``(logprob of token i, [(id, logprob), ...] of the top
    ones)``. Offsets count from ``text_offset`` (the characters of the tokens before these)."""
    tokens, offsets = [], []
    for t in token_ids:
        offsets.append(text_offset)
        tokens.append(_token_text(tokenizer, t))
        text_offset += len(tokens[-1])
    return {
        "tokens": tokens,
        "token_logprobs": [lp for lp, _ in entries],
        "top_logprobs": [{_token_text(tokenizer, i): lp for i, lp in top} for _, top in entries],
        "text_offset": offsets,
    }, text_offset


def chat_logprobs(tokenizer, token_ids: list[int], entries: list) -> dict:
    """OpenAI's chat ``logprobs`` object (``{"content": [...]}``) for generated tokens."""

    def item(token: int, lp: float) -> dict:
        text = _token_text(tokenizer, token)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(t, lp), "top_logprobs": [item(i, x) for i, x in top]}
                        for t, (lp, top) in zip(token_ids, entries)]}

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

import re
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, ValidationError


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


def generate_kwargs(req: _SamplingRequest, max_tokens: int, logprobs: int | None, stop: list[str]) -> dict:
    """OpenAI's sampling fields -> keyword arguments of the engine's ``generate()`` settings (the
    one mapping the in-process API uses: fields a request leaves unset fall back to the model's
    generation config, as transformers' ``generate`` does). Temperature 0 is greedy decoding."""
    if req.temperature is not None and not req.temperature >= 0:
        raise OpenAIError(f"temperature must be >= 0, got {req.temperature}", param="temperature")
    if req.logit_bias:
        raise OpenAIError("logit_bias is not supported by this server", param="logit_bias")
    kw: dict[str, Any] = dict(
        max_new_tokens=max_tokens, seed=req.seed, ignore_eos=req.ignore_eos, top_p=req.top_p,
        top_k=0 if req.top_k == -1 else req.top_k,  # vLLM's -1: off
        min_p=req.min_p, repetition_penalty=req.repetition_penalty, presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty, min_new_tokens=req.min_tokens, logprobs=logprobs,
        stop_strings=tuple(stop) or None,
        stop_token_ids=tuple(int(t) for t in req.stop_token_ids) if req.stop_token_ids else None,
    )
    if req.temperature == 0:
        kw["do_sample"] = False
    else:  # OpenAI samples by default (temperature: the request's, else the generation config's, else 1)
        kw.update(do_sample=True, temperature=req.temperature)
    return kw


_ENGINE_FIELD = re.compile(r"SamplingParams\.(\w+)=|generate\(\): (\w+)[=:]")


def engine_error(e: ValueError, names: dict[str, str]) -> OpenAIError:
    """The engine refused a request's settings: a 400 naming the request's field (``names`` maps
    the engine's field names to the request's where they differ)."""
    m = _ENGINE_FIELD.search(str(e))
    field = (m.group(1) or m.group(2)) if m else None
    field = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "stop_strings": "stop",
             "do_sample": "temperature", **names}.get(field, field)
    return OpenAIError(str(e), param=field)


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
        "top_logprobs": [_by_text(tokenizer, top) for _, top in entries],
        "text_offset": offsets,
    }, text_offset


def _by_text(tokenizer, top: list) -> dict:
    """{token text: logprob}; of ids that decode to the same text the likeliest stays."""
    out: dict[str, float] = {}
    for i, lp in top:
        out.setdefault(_token_text(tokenizer, i), lp)
    return out


def chat_logprobs(tokenizer, token_ids: list[int], entries: list) -> dict:
    """OpenAI's chat ``logprobs`` object (``{"content": [...]}``) for generated tokens."""

    def item(token: int, lp: float) -> dict:
        text = _token_text(tokenizer, token)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(t, lp), "top_logprobs": [item(i, x) for i, x in top]}
                        for t, (lp, top) in zip(token_ids, entries)]}

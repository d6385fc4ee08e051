"""Acceptance of a verify step's drafts: greedy (:func:`accept_greedy`: the longest prefix of
drafts equal to the target's argmax, plus the target's token after it) and speculative rejection
sampling (:func:`accept_sampled`, exact for the target's distribution after the request's
temperature / top-k / top-p, :func:`target_probs`), then the cut at a stop token or
``max_new_tokens`` (:func:`truncate_at_stop`). :class:`~.decoder.SpeculativeDecoder` applies
them to the logits of every verify position."""

from __future__ import annotations

import torch

from ..request import Request
from ..sampling import SamplingParams, transform_logits


def accept_greedy(target_tokens: torch.Tensor | list[list[int]], drafts: torch.Tensor | list[list[int]]) -> list[list[int]]:
    """Greedy acceptance for a batch (on the host: one device->host copy of the target tokens).

    Args:
        target_tokens: ``[B, L]`` the target's argmax at each verify position (position j
            predicts the token after draft j; position 0 after the pending token).
        drafts: ``[B, L - 1]`` the draft tokens.

    Returns:
        Per request the emitted tokens: the longest prefix of drafts that equals the target's
        tokens, then the target's token at the first mismatch (or after the last draft).
    """
    rows = target_tokens.tolist() if isinstance(target_tokens, torch.Tensor) else target_tokens
    drafts = drafts.tolist() if isinstance(drafts, torch.Tensor) else drafts
    out = []
    for row, draft in zip(rows, drafts):
        n = 0
        while n < len(draft) and draft[n] == row[n]:
            n += 1
        out.append(row[: n + 1])
    return out


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``[L, V]`` fp32 logits -> the request's sampling distribution at each position
    (temperature, top-k, top-p as the Sampler applies them)."""
    return torch.stack(
        [transform_logits(row, params.temperature, params.top_k, params.top_p) for row in logits.float()]
    ).softmax(dim=-1)


def accept_sampled(
    probs: torch.Tensor,
    drafts: list[int],
    generator: torch.Generator,
    draft_probs: torch.Tensor | None = None,
) -> list[int]:
    """Speculative (rejection) sampling of one request.

    Draft ``x = drafts[j]`` is accepted with probability ``min(1, p_j(x) / q_j(x))``; at the first
    rejection the emitted token is drawn from ``normalize(max(0, p_j - q_j))`` and the run ends;
    when every draft is accepted a bonus token is drawn from ``p_k``. The emitted tokens are
    then distributed exactly as sequential samples from the target (Leviathan et al. 2023).

    Args:
        probs: ``[k + 1, V]`` target distributions (``target_probs``).
        drafts: the k draft tokens.
        generator: the request's generator (the Sampler's, so seeded requests are reproducible).
        draft_probs: ``[k, V]`` the draft distributions, or None for a deterministic draft
            source (one-hot ``q``: accept with probability ``p_j(x)``, resample from ``p_j``
            without ``x``).
    """
    out: list[int] = []
    for j, x in enumerate(drafts):
        p = probs[j]
        qx = 1.0 if draft_probs is None else float(draft_probs[j, x])
        u = float(torch.rand((), generator=generator, device=generator.device))
        if u * qx < float(p[x]):
            out.append(x)
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[x] = 0.0
        else:
            residual = (p - draft_probs[j].to(p.dtype)).clamp(min=0.0)
        if not float(residual.sum()) > 0.0:  # p <= q everywhere only if p == q: no rejection
            residual = p
        out.append(int(torch.multinomial(residual, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(probs[len(drafts)], 1, generator=generator)))
    return out


def truncate_at_stop(request: Request, tokens: list[int]) -> list[int]:
    """The emitted tokens the request keeps: up to and including its first stop token, and no
    more than its remaining ``max_new_tokens``."""
    kept = tokens[: request.params.max_new_tokens - len(request.output)]
    for i, t in enumerate(kept):
        if t in request.stop_ids:
            return kept[: i + 1]
    return kept

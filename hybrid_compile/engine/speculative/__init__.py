"""Speculative decoding for hybrid models: draft sources (n-gram, replay, draft models), the
target verify step with per-step intermediate states, acceptance (greedy and rejection
sampling) and the commit of the accepted state, KV and tokens.

``EngineConfig.speculative`` takes a :class:`SpeculativeConfig` (or a dict of its fields); the
engine then runs its decode steps through :class:`~.verify.SpeculativeDecoder`.
"""

from .config import DraftSource, SpeculativeConfig
from .drafts import EngineDraftModel, HFDraftModel, NgramDraft, ReplayDraft, build_draft_source
from .verify import SpeculativeDecoder, accept_greedy, accept_sampled, target_probs, truncate_at_stop

__all__ = [
    "DraftSource", "EngineDraftModel", "HFDraftModel", "NgramDraft", "ReplayDraft", "SpeculativeConfig",
    "SpeculativeDecoder", "accept_greedy", "accept_sampled", "build_draft_source", "target_probs", "truncate_at_stop",
]

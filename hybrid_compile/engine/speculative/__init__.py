"""Speculative decoding for hybrid models: draft sources (n-gram, replay, draft models, the MTP
head), the target verify step with per-step intermediate states, acceptance (greedy and
rejection sampling) and the commit of the accepted state, KV and tokens.

``EngineConfig.speculative`` takes a :class:`SpeculativeConfig` (or a dict of its fields); the
engine then runs its decode steps through :class:`~.decoder.SpeculativeDecoder`.

- ``config.py``: :class:`SpeculativeConfig`, the :class:`DraftSource` protocol and
  :class:`DraftTarget` (what a draft source reads of the target engine);
- ``drafts.py``: the draft sources and :func:`build_draft_source`; ``mtp.py``: the MTP head's
  (``mtp_graphs.py``: its proposals as CUDA graphs; ``token_map.py``: its draft token map);
- ``acceptance.py``: greedy and sampled acceptance, the cut at a stop token;
- ``tree.py``: draft trees (``topk > 1``): :class:`DraftTree`, building one from a draft's top-k,
  its verify metadata, greedy and sampled acceptance along it;
- ``decoder.py``: :class:`SpeculativeDecoder` (the draft + verify + commit step) and
  :class:`~.decoder.CommitGraphs`.
"""

from .acceptance import accept_greedy, accept_sampled, target_probs, truncate_at_stop
from .config import DraftSource, DraftTarget, SpeculativeConfig
from .decoder import SpeculativeDecoder
from .drafts import EngineDraftModel, HFDraftModel, NgramDraft, ReplayDraft, build_draft_source
from .tree import DraftTree, accept_tree_greedy, accept_tree_sampled, tree_from_topk_chain

__all__ = [
    "DraftSource", "DraftTarget", "DraftTree", "EngineDraftModel", "HFDraftModel", "NgramDraft", "ReplayDraft", "SpeculativeConfig",
    "SpeculativeDecoder", "accept_greedy", "accept_sampled", "accept_tree_greedy", "accept_tree_sampled", "build_draft_source",
    "target_probs", "tree_from_topk_chain", "truncate_at_stop",
]

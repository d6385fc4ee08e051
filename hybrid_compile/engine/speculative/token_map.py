"""The draft token map of MTP drafts (``SpeculativeConfig.draft_token_map``): reading it from a
file, a list or a tensor into a 1-D int64 tensor of distinct token ids, with one clear error per
bad content.

With a map of N ids the MTP head's LM head is the N rows of the target's LM head for those ids
(``models/mtp.py``, :meth:`~hybrid_compile.models.mtp.MTPHead.restrict_vocabulary`): a head
forward reads an N x H matrix instead of the vocabulary's, and its drafts are always ids of the
map. Verification by the target is unchanged, so outputs are too; only drafts of tokens outside
the map are lost (EAGLE's "hot vocabulary", SGLang's ``--speculative-token-map``).
"""

from __future__ import annotations

import json
import os

import torch

FIELD = "SpeculativeConfig.draft_token_map"
#: the file types :func:`read_token_map` reads (suffix -> what it holds)
FILE_TYPES = {".pt": "a torch.save'd 1-D integer tensor or list", ".pth": "as .pt",
              ".npy": "a 1-D integer numpy array", ".json": "a JSON list of integers"}


def _load_file(path: str):
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in FILE_TYPES:
        raise ValueError(f"{FIELD}={path!r}: unknown file type {suffix!r} (one of "
                         f"{', '.join(f'{s} ({what})' for s, what in FILE_TYPES.items())})")
    if not os.path.isfile(path):
        raise ValueError(f"{FIELD}={path!r}: no such file")
    if suffix == ".json":
        with open(path) as f:
            return json.load(f)
    if suffix == ".npy":
        import numpy as np

        return np.load(path, allow_pickle=False)
    return torch.load(path, map_location="cpu", weights_only=True)


def read_token_map(value, vocab_size: int | None = None) -> torch.Tensor:
    """``value`` (a path to a ``.pt`` / ``.pth`` / ``.npy`` / ``.json`` file, a sequence of ints, a
    1-D integer tensor or numpy array) -> the map as a 1-D int64 CPU tensor, in the given order.

    Raises a ValueError naming the field for a map that is not 1-D integers, empty, has duplicate
    or negative ids or (``vocab_size`` given) ids ``>= vocab_size``."""
    source = value
    if isinstance(value, (str, os.PathLike)):
        value = _load_file(os.path.expanduser(os.fspath(value)))
        source = os.fspath(source)
    where = f"{FIELD} ({source!r})" if isinstance(source, str) else FIELD
    if isinstance(value, torch.Tensor):
        ids = value.detach().cpu()
    else:
        bad = [v for v in value if isinstance(v, bool) or not isinstance(v, int)] if isinstance(value, (list, tuple)) else []
        if bad:
            raise ValueError(f"{where} must hold integer token ids, got {bad[0]!r}")
        try:
            ids = torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError) as e:
            raise ValueError(f"{where} must be a path, a list of token ids or a 1-D integer tensor, "
                             f"got {type(value).__name__} ({e})") from None
    if ids.numel() == 0:
        raise ValueError(f"{where} is empty: it needs at least one token id")
    if ids.dtype == torch.bool or ids.dtype.is_floating_point or ids.dtype.is_complex:
        raise ValueError(f"{where} must hold integer token ids, got dtype {ids.dtype}")
    if ids.dim() != 1:
        raise ValueError(f"{where} must be 1-D (one token id each), got shape {tuple(ids.shape)}")
    ids = ids.to(torch.int64)
    if int(ids.min()) < 0:
        raise ValueError(f"{where} holds a negative token id ({int(ids.min())})")
    if vocab_size is not None and int(ids.max()) >= vocab_size:
        raise ValueError(f"{where} holds token id {int(ids.max())}, outside the vocabulary of {vocab_size} ids")
    unique, counts = torch.unique(ids, return_counts=True)
    if unique.numel() != ids.numel():
        raise ValueError(f"{where} holds duplicate token ids (e.g. {int(unique[counts > 1][0])})")
    return ids.contiguous()


__all__ = ["FIELD", "read_token_map"]

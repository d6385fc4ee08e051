"""Reference of the draft-TREE verify ops (``parent_indices`` of the recurrent verify ops,
``tree_mask`` of ``paged_attention_extend``): a tree is checked node by node as chains. Every
node's root path is run through a chain reference (the per-token recurrences of this package);
the path's last step is the node's output and stored state. Knows nothing of how the ops walk a
tree.
"""

from __future__ import annotations

from typing import Callable

import torch


def root_path(parents: list[int], node: int) -> list[int]:
    """The verify tokens from the root (parent -1) down to ``node``, in order."""
    out = []
    while node >= 0:
        out.append(node)
        node = parents[node]
    return out[::-1]


def ancestor_bits(parents: list[int]) -> list[int]:
    """Per token the int64 mask of its root path's tokens (``tree_mask``'s meaning), from the paths."""
    out = []
    for node in range(len(parents)):
        bits = sum(1 << a for a in root_path(parents, node))
        out.append(bits - (1 << 64) if bits >= 1 << 63 else bits)
    return out


def tree_by_paths(run_chain: Callable, per_token: list[torch.Tensor], parents: torch.Tensor):
    """``run_chain(b, inputs, n) -> (outputs [1, n, ...], states [1, n, ...])``: the chain
    reference of row ``b`` over ``inputs`` (each ``per_token`` tensor's row ``b`` gathered along a
    root path of ``n`` tokens). Returns (outputs ``[B, L, ...]``, states ``[B, L, ...]``): node
    ``t``'s are the last step of its root path's chain."""
    batch, steps = parents.shape
    outs, states = [], []
    for t in range(steps):
        o_t, s_t = [], []
        for b in range(batch):
            path = torch.tensor(root_path(parents[b].tolist(), t))
            o, s = run_chain(b, [x[b:b + 1].cpu()[:, path] for x in per_token], len(path))
            o_t.append(o[0, -1])
            s_t.append(s[0, -1])
        outs.append(torch.stack(o_t))
        states.append(torch.stack(s_t))
    return torch.stack(outs, 1), torch.stack(states, 1)


def random_parents(batch: int, nodes: int, gen: torch.Generator) -> torch.Tensor:
    """``[batch, nodes]`` int32 random trees: node 0 the root, each other under an earlier node."""
    rows = [[-1] + [int(torch.randint(0, t, (1,), generator=gen)) for t in range(1, nodes)] for _ in range(batch)]
    return torch.tensor(rows, dtype=torch.int32)


#: A forest of 11 nodes: nodes 0, 2 and 5 start from the slot's state.
FOREST_11 = [-1, 0, -1, 2, 1, -1, 5, 5, 0, 3, 8]


def trees_forest_and_chain(batch: int, gen: torch.Generator) -> torch.Tensor:
    """``[batch, 11]`` int32: :func:`random_parents` rows, then :data:`FOREST_11` and a chain as the
    last two rows (the cases a per-path kernel must get right besides random trees)."""
    parents = random_parents(batch, len(FOREST_11), gen)
    parents[-2] = torch.tensor(FOREST_11, dtype=torch.int32)
    parents[-1] = torch.arange(-1, len(FOREST_11) - 1, dtype=torch.int32)
    return parents

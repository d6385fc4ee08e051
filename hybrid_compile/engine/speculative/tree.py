"""Draft trees (``SpeculativeConfig.topk > 1``): their shape, how one is built from a draft's
top-k candidates, its verify metadata, and acceptance along it.

A verify row of a tree has ``L = nodes + 1`` tokens: node 0 is the request's pending token (the
root), nodes ``1 .. L-1`` the drafts, each after its parent (``parent < node``), so a chain is
the tree whose node ``j`` has parent ``j - 1``. The target runs every node at position
``prefix + depth(node)``, attending to the prefix and the node's ancestors
(:func:`ancestor_bits`, the attention op's ``tree_mask``), and its recurrent layers start each
node from its parent's state (:func:`verify_parents`, the ops' ``parent_indices``).

Acceptance walks the tree from the root: greedy (:func:`accept_tree_greedy`) keeps the longest
path whose every token is the target's argmax after its parent; sampling
(:func:`accept_tree_sampled`) tries the children in order with the recursive rejection scheme
for deterministic drafts (accept child ``x`` with probability ``p(x)``, else remove ``x`` from
``p`` and renormalise; when no child is left, sample the residual), which emits exactly the
target's distribution. Both return the emitted tokens and the accepted path (the node of each
kept token): the decoder moves the path's KV into the positions it takes and commits the state of
its last node.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class DraftTree:
    """One request's draft nodes: ``tokens[i]`` is node ``i + 1`` of the verify row, its parent
    ``parents[i]`` (0: the root, the pending token; ``j``: node ``j``), ``parents[i] <= i``."""

    tokens: list[int]
    parents: list[int]

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"DraftTree: {len(self.tokens)} tokens but {len(self.parents)} parents")
        for i, p in enumerate(self.parents):
            if not 0 <= p <= i:
                raise ValueError(f"DraftTree: node {i + 1} has parent {p}: a parent is the root (0) or an earlier node")

    @classmethod
    def chain(cls, tokens: list[int]) -> "DraftTree":
        return cls(list(tokens), list(range(len(tokens))))

    def __len__(self) -> int:
        return len(self.tokens)


# -- verify metadata of a row -----------------------------------------------------------------


def verify_parents(tree: DraftTree) -> list[int]:
    """Parent of every verify token of the row (root -1): the recurrent ops' ``parent_indices``."""
    return [-1] + list(tree.parents)


def depths(parents: list[int]) -> list[int]:
    """Depth of every verify token (root 0) from :func:`verify_parents`: its position offset."""
    out: list[int] = []
    for p in parents:
        out.append(0 if p < 0 else out[p] + 1)
    return out


def ancestor_bits(parents: list[int]) -> list[int]:
    """Per verify token, the bit mask of the row's tokens it attends to (its ancestors and
    itself), as a signed int64 (bit 63 set -> negative): the attention op's ``tree_mask``."""
    out: list[int] = []
    for j, p in enumerate(parents):
        bits = (1 << j) | (out[p] if p >= 0 else 0)
        out.append(bits - (1 << 64) if bits >= 1 << 63 else bits)
    return out


def tree_metadata(trees: list[DraftTree]) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """(parents, depths, ancestor bits) of every verify token of each tree's row: what the verify
    step's forward batch is built from (``ForwardBatchBuilder.build_verify``)."""
    parents = [verify_parents(t) for t in trees]
    return parents, [depths(p) for p in parents], [ancestor_bits(p) for p in parents]


def _children(parents: list[int]) -> list[list[int]]:
    kids: list[list[int]] = [[] for _ in parents]
    for j, p in enumerate(parents):
        if p >= 0:
            kids[p].append(j)
    return kids


# -- building and filling -----------------------------------------------------------------------


def tree_from_topk_chain(candidates: list[list[tuple[int, float]]], budget: int) -> DraftTree:
    """The tree of a draft that ran its greedy chain: ``candidates[d]`` are the draft's top-k
    ``(token, log-probability)`` at depth ``d + 1`` (given the chain so far), best first; the
    chain continues with each depth's first. Every candidate hangs under the chain's node of the
    depth before; the ``budget`` nodes of highest cumulative log-probability are kept (a node's
    score never exceeds its parent's, so the kept set is a tree; ties go to the shallower node).
    Nodes are numbered by depth, then rank."""
    scored = []
    chain_score = 0.0
    for d, cands in enumerate(candidates):
        for rank, (token, logp) in enumerate(cands):
            scored.append((-(chain_score + logp), d, rank, int(token)))
        if cands:
            chain_score += cands[0][1]
        else:
            break
    kept = sorted(sorted(scored)[:budget], key=lambda s: (s[1], s[2]))
    tokens: list[int] = []
    parents: list[int] = []
    node_of: dict[tuple[int, int], int] = {}  # (depth, rank) -> its verify node
    for _, d, rank, token in kept:
        parent = 0 if d == 0 else node_of[(d - 1, 0)]
        tokens.append(token)
        parents.append(parent)
        node_of[(d, rank)] = len(tokens)
    return DraftTree(tokens, parents)


def fill_tree(tree: DraftTree, nodes: int, pending: int) -> DraftTree:
    """``tree`` with exactly ``nodes`` nodes: cut (its first ``nodes``: parents precede children),
    or filled as fill_drafts fills a chain: a chain of copies of its last token (the pending token
    when it has none) under its last node; then renumbered :func:`chain_first`."""
    tokens, parents = list(tree.tokens[:nodes]), list(tree.parents[:nodes])
    while len(tokens) < nodes:
        parents.append(len(tokens))
        tokens.append(tokens[-1] if tokens else pending)
    return chain_first(DraftTree(tokens, parents))


def chain_first(tree: DraftTree) -> DraftTree:
    """The same tree with its first-child chain (from the root, each node's lowest-numbered child:
    the draft's own greedy chain, as the sources number their nodes) as nodes ``1 .. d`` and the
    other nodes after it in their order (parents still precede children). Verify token ``j`` of a
    row takes KV slot ``j``, and the accepted path's K/V moves to the slots of positions
    ``prefix + depth`` (``SpeculativeDecoder._move_path_kv``): with the chain first, a step that
    accepts a prefix of the draft's chain (the common case) moves nothing."""
    kids = _children(verify_parents(tree))
    chain = []
    node = 0
    while kids[node]:
        node = kids[node][0]
        chain.append(node)
    if chain == list(range(1, len(chain) + 1)):
        return tree
    on_chain = set(chain)
    order = chain + [j for j in range(1, len(tree) + 1) if j not in on_chain]  # new node i + 1 = old order[i]
    new_of = {0: 0, **{old: i + 1 for i, old in enumerate(order)}}
    return DraftTree([tree.tokens[old - 1] for old in order], [new_of[tree.parents[old - 1]] for old in order])


# -- acceptance ---------------------------------------------------------------------------------


def accept_tree_greedy(targets: list[int], tree: DraftTree) -> tuple[list[int], list[int]]:
    """Greedy acceptance along a tree: ``targets[j]`` is the target's argmax after verify token
    ``j``. A node is accepted when its token equals the target's token after its parent and its
    parent is accepted; the deepest accepted node wins (siblings may repeat a token: the first of
    the deepest). Returns (emitted tokens, accepted path): the path's drafts then the target's
    token after the path's last node; the path holds the root and the accepted nodes (one per
    emitted token)."""
    parents = verify_parents(tree)
    tokens = [None] + list(tree.tokens)
    best = [0]  # the longest accepted path so far
    paths = {0: [0]}
    for c in range(1, len(parents)):  # parents precede children: one pass in node order
        p = parents[c]
        if p in paths and tokens[c] == targets[p]:
            paths[c] = paths[p] + [c]
            if len(paths[c]) > len(best):
                best = paths[c]
    return [tokens[c] for c in best[1:]] + [targets[best[-1]]], best


def accept_tree_sampled(probs: torch.Tensor, tree: DraftTree, generator: torch.Generator) -> tuple[list[int], list[int]]:
    """Tree rejection sampling for deterministic drafts (module docstring): ``probs`` ``[L, V]``
    the target's distribution after each verify token. Returns (emitted tokens, accepted path)
    as :func:`accept_tree_greedy`; the emitted tokens are distributed exactly as sequential
    samples from the target."""
    parents = verify_parents(tree)
    kids = _children(parents)
    tokens = [None] + list(tree.tokens)
    node, emitted, path = 0, [], [0]
    while True:
        p = probs[node].clone()
        accepted = None
        for c in kids[node]:
            x = tokens[c]
            total = float(p.sum())
            u = float(torch.rand((), generator=generator, device=generator.device))
            if total > 0.0 and u * total < float(p[x]):
                accepted = c
                break
            p[x] = 0.0  # rejected: the residual is p without x (renormalised by the next draw)
        if accepted is None:
            if not float(p.sum()) > 0.0:  # every token with mass was a rejected child: impossible
                p = probs[node]          # (p(x) = 1 is always accepted); kept for float safety
            emitted.append(int(torch.multinomial(p, 1, generator=generator)))
            return emitted, path
        emitted.append(tokens[accepted])
        node = accepted
        path.append(node)


# -- what a draft source's chain gives ----------------------------------------------------------


def pick_next(logits: torch.Tensor, topk: int, token_map: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """One step of a draft's greedy chain from its ``[B, V]`` logits: (the chain's tokens ``[B]``,
    with ``topk > 1`` also the ``[B, topk]`` top-k tokens and their log-probabilities, best first;
    the chain continues with the first). On the device. ``token_map``: the logits are over a
    restricted vocabulary whose column ``i`` is token ``token_map[i]`` (an MTP head's draft token
    map): the picked columns are mapped to their token ids."""
    if topk == 1:
        tokens = torch.ops.hybrid_compile.argmax_rows(logits)
        # (index_select: a gather kernel, no host sync, so the proposal graphs capture it)
        return (tokens if token_map is None else token_map.index_select(0, tokens)), None
    values, tokens = torch.topk(torch.log_softmax(logits.float(), dim=-1), min(topk, logits.shape[-1]), dim=-1)
    if token_map is not None:
        tokens = token_map[tokens]
    return tokens[:, 0].contiguous(), (tokens, values)


def candidate_rows(steps: list[tuple[torch.Tensor, torch.Tensor]]) -> list[list[list[tuple[int, float]]]]:
    """A chain's per-step top-k (``pick_next``'s, ``[B, topk]`` each) -> per request, per depth,
    ``(token, log-probability)`` candidates: ``tree_from_topk_chain``'s input (one host copy)."""
    if not steps:
        return []
    tokens = torch.stack([t for t, _ in steps], 1).tolist()  # [B, depth, topk]
    logps = torch.stack([lp for _, lp in steps], 1).tolist()
    return [[list(zip(tt, ll)) for tt, ll in zip(tb, lb)] for tb, lb in zip(tokens, logps)]

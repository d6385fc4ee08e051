"""Prefix cache: the hybrid radix tree over token ids whose nodes hold KV indices and
optional Mamba-state slots, with locks, copy-on-write, tombstones and dual LRU eviction.
(Filled by the prefix-cache issue.)
"""

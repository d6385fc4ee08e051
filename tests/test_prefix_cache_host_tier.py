"""The prefix cache's host tier (``EngineConfig.prefix_cache_host_tier``) in the engine.

A workload of prompt groups with shared system prompts, run in waves on a KV pool too small to
keep every group: the device evicts the older groups' nodes to the host, and a later wave of the
first group hits them there (loaded back before the request's first extend). The greedy tokens
must equal the engine with the tier off and transformers' ``generate``; the host counters say
that the tier was written, hit and evicted; after ``clear_prefix_cache()`` every device and host
slot is free. On the CPU the "host" pool is a second set of CPU tensors.
"""

from __future__ import annotations

import functools

import pytest

from engine_models import assert_greedy_equal, cached_model, hf_greedy_cached, make_engine, single_threaded, vocab_size

NAME = "qwen3_next_dense"
MAX_NEW = 4
ARGS = dict(max_running_requests=2, max_total_tokens=320, mamba_cache_size=8, chunked_prefill_size=128)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    yield from single_threaded()


def _model(name: str = NAME):
    if name == "bamba":  # Mamba2 mixers (chunk 16) beside attention
        return _bamba()
    return cached_model(name, 0)


@functools.lru_cache(maxsize=None)
def _bamba():
    import mamba2_models as mm

    return mm.build_bamba(4)


def _waves(vocab: int) -> list[list[list[int]]]:
    """Groups 0, 1, 2 (a 128-token system prompt each + short questions), then group 0 again
    with new questions and one repeated prompt."""
    import torch

    g = torch.Generator().manual_seed(7)

    def rand(n):
        return torch.randint(1, vocab, (n,), generator=g).tolist()

    systems = [rand(128) for _ in range(3)]
    waves = [[s + rand(8), s + rand(12)] for s in systems]
    waves.append([systems[0] + rand(10), list(waves[0][0])])
    return waves


def _run(engine, waves):
    return [engine.generate_batch(w, max_new_tokens=MAX_NEW) for w in waves]


@pytest.mark.parametrize("name,page_size", [(NAME, 1), (NAME, 4), ("bamba", 1)])
def test_host_tier_hits_equal_tier_off_and_transformers(name, page_size):
    model = _model(name)
    waves = _waves(vocab_size(model))
    off = make_engine(model, page_size=page_size, **ARGS)
    outputs_off = _run(off, waves)
    off_stats = off.stats()["prefix_cache"]
    off.close()
    engine = make_engine(model, page_size=page_size, prefix_cache_host_tier=True, prefix_cache_host_bytes=4 << 20, **ARGS)
    outputs = _run(engine, waves)
    assert outputs == outputs_off
    for wave, outs in zip(waves, outputs):
        for prompt, out in zip(wave, outs):
            assert_greedy_equal(model, prompt, out, hf_greedy_cached(model, ("host-tier", name), prompt, MAX_NEW))
    st = engine.stats()["prefix_cache"]
    assert st["host_tier"] and st["host_written_tokens"] > 0 and st["kv_evicted_tokens"] > 0, st
    assert st["host_hits"] > 0 and st["host_loaded_tokens"] > 0 and st["host_hit_tokens"] > 0, st
    assert st["host_pool"]["load_bytes"] > 0 and st["host_pool"]["write_bytes"] > 0
    # the last wave hits group 0's system prompt: from the host with the tier, recomputed without it
    assert st["admitted_hit_tokens"] > off_stats["admitted_hit_tokens"], (st, off_stats)
    engine.prefix_cache.check_invariants()
    engine.clear_prefix_cache()
    engine.pools.check_all_free()
    host = engine.host_pool
    assert host.kv_allocator.used() == 0 and host.mamba_allocator.used() == 0
    engine.close()


def test_host_tier_evicts_on_the_host_when_it_is_small():
    """A host tier of a few pages: host eviction and dropped writes happen, tokens stay right."""
    model = _model()
    waves = _waves(vocab_size(model))
    engine = make_engine(model, **ARGS)
    kv, mamba = engine.pools.kv, engine.pools.mamba
    kv_bytes = kv.total() * kv.bytes_per_token
    engine.close()
    # ~160 tokens of KV on the host (HostPool.from_budget gives KV the device pools' share)
    size = int(160 * kv.bytes_per_token * (kv_bytes + mamba.total() * mamba.bytes_per_slot) / kv_bytes)
    engine = make_engine(model, prefix_cache_host_tier=True, prefix_cache_host_bytes=size, **ARGS)
    outputs = _run(engine, waves)
    for wave, outs in zip(waves, outputs):
        for prompt, out in zip(wave, outs):
            assert_greedy_equal(model, prompt, out, hf_greedy_cached(model, ("host-tier", NAME), prompt, MAX_NEW))
    st = engine.stats()["prefix_cache"]
    assert engine.host_pool.kv_capacity() <= 160
    assert st["host_evicted_tokens"] > 0 or st["host_write_failed"] > 0, st
    engine.prefix_cache.check_invariants()
    engine.clear_prefix_cache()
    engine.pools.check_all_free()
    engine.close()


def test_host_tier_options_are_honoured_or_refused(monkeypatch):
    model = _model()
    with pytest.raises(ValueError, match="needs enable_prefix_cache"):
        make_engine(model, prefix_cache_host_tier=True, enable_prefix_cache=False, **ARGS)
    with pytest.raises(ValueError, match="prefix_cache_host_bytes is set but prefix_cache_host_tier is False"):
        make_engine(model, prefix_cache_host_bytes=1 << 20, **ARGS)
    with pytest.raises(ValueError, match="prefix_cache_host_fraction is set but prefix_cache_host_tier is False"):
        make_engine(model, prefix_cache_host_fraction=0.1, **ARGS)
    with pytest.raises(ValueError, match="both size the host tier"):
        make_engine(model, prefix_cache_host_tier=True, prefix_cache_host_bytes=1 << 20,
                    prefix_cache_host_fraction=0.1, **ARGS)
    with pytest.raises(ValueError, match="exceeds the available host memory"):
        make_engine(model, prefix_cache_host_tier=True, prefix_cache_host_bytes=1 << 60, **ARGS)
    with pytest.raises(ValueError, match="cannot hold one KV page"):
        make_engine(model, prefix_cache_host_tier=True, prefix_cache_host_bytes=16, **ARGS)
    with pytest.raises(ValueError, match="prefix_cache_host_fraction"):
        make_engine(model, prefix_cache_host_tier=True, prefix_cache_host_fraction=1.5, **ARGS)
    # default size: a fraction of the available host memory
    from hybrid_compile.memory.sizing import available_device_memory

    engine = make_engine(model, prefix_cache_host_tier=True, prefix_cache_host_fraction=0.001, **ARGS)
    assert 0 < engine.host_pool.nbytes() <= 0.001 * available_device_memory("cpu") * 1.05
    assert engine.stats()["prefix_cache"]["host_pool"]["pinned"] is False  # CPU pools
    engine.close()
    from hybrid_compile.memory import host_pool

    # neither size: the default fraction (made small here: the real 0.25 of the host is gigabytes)
    monkeypatch.setattr(host_pool, "DEFAULT_HOST_FRACTION", 0.002)
    available = available_device_memory("cpu")
    engine = make_engine(model, prefix_cache_host_tier=True, **ARGS)
    assert 0.001 * available < engine.host_pool.nbytes() <= 0.002 * available * 1.05
    engine.close()


@pytest.mark.gpu
@pytest.mark.smoke
def test_host_pool_on_cuda_round_trips_while_the_slots_are_reused():
    """Pinned host memory, writes on the side stream: device slots overwritten on the current
    stream right after a write (the gather must come first) and loads queued right after writes
    (they must wait for the copy to the host) still give back exactly what was written."""
    import torch

    from hybrid_compile.memory import AttentionLayerSpec, MambaLayerSpec, MemoryPools
    from hybrid_compile.memory.host_pool import HostPool

    attn = [AttentionLayerSpec((1, 3), num_kv_heads=2, head_dim=128, dtype=torch.bfloat16)]
    linear = [MambaLayerSpec((0, 2), conv_width=4, conv_dim=1024, state_shape=(8, 128, 128), conv_dtype=torch.bfloat16)]
    pools = MemoryPools.from_specs(attn, linear, device="cuda", max_running_requests=4, max_context_len=4096,
                                   max_total_tokens=8192, mamba_cache_size=16)
    host = HostPool(pools.kv, pools.mamba, 8192, 16)
    assert host.pin and all(h.is_pinned() for _, _, h in host.kv_buffers + host.mamba_buffers)
    for buf in (*pools.kv.k_buffers, *pools.kv.v_buffers, *pools.mamba.conv_buffers, *pools.mamba.ssm_buffers):
        buf.copy_(torch.randn(buf.shape, device="cuda").to(buf.dtype))
    slots = torch.arange(1, 4001)
    want_k = pools.kv.k_buffers[0][:, slots.cuda()].clone()
    want_ssm = pools.mamba.ssm_buffers[0][:, 3].clone()
    start = host.write_kv(slots)
    hslot = host.write_mamba(3)
    for buf in (*pools.kv.k_buffers, *pools.mamba.ssm_buffers):  # the slots are reused at once
        buf.zero_()
    dst = torch.arange(4001, 8001)
    host.load_kv(start, dst)
    host.load_mamba(hslot, 5)
    torch.cuda.synchronize()
    assert torch.equal(pools.kv.k_buffers[0][:, dst.cuda()], want_k)
    assert torch.equal(pools.mamba.ssm_buffers[0][:, 5], want_ssm)
    host.synchronize()


@pytest.mark.gpu
def test_host_tier_on_cuda_equals_tier_off():
    import copy

    model = copy.deepcopy(_model()).to("cuda")
    waves = _waves(vocab_size(model))
    outs = {}
    for tier in (False, True):
        kw = dict(prefix_cache_host_tier=True, prefix_cache_host_bytes=64 << 20) if tier else {}
        engine = make_engine(model, **ARGS, **kw)
        outs[tier] = _run(engine, waves)
        if tier:
            st = engine.stats()["prefix_cache"]
            assert st["host_hits"] > 0 and st["host_loaded_tokens"] > 0 and st["host_pool"]["pinned"], st
            engine.prefix_cache.check_invariants()
            engine.clear_prefix_cache()
            engine.pools.check_all_free()
        engine.close()
    assert outs[True] == outs[False]


def test_benchmark_host_tier_tiny_run(tmp_path):
    """``benchmarks/prefix_cache.py --tiny --host-tier``: lru and lru_host side by side, the
    host tier hit under memory pressure, and the load-back / copy rates are measured."""
    import importlib.util
    import json
    import pathlib
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root))
    try:
        spec = importlib.util.spec_from_file_location("prefix_cache_bench_host", root / "benchmarks" / "prefix_cache.py")
        bench = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(bench)
        out = tmp_path / "run.json"
        bench.main(["--tiny", "--host-tier", "--systems", "lru", "lru_host", "--groups", "3", "--prompts-per-group",
                    "3", "--system-len", "330", "--output-len", "2", "--pressure-wave", "3", "--out", str(out)])
    finally:
        sys.path.remove(str(root))
    run = json.loads(out.read_text())
    assert set(run["shared_prefix"]) == {"lru", "lru_host"}
    host = run["pressure"]["lru_host"]["cache"]
    assert host["host_hits"] > 0 and host["host_hit_tokens"] > 0, host
    assert host["token_hit_rate"] >= run["pressure"]["lru"]["cache"]["token_hit_rate"]
    rate = run["load_back"]["lru_host"]
    assert rate["load_back_gb_s"] > 0 and rate["host_to_device_copy_gb_s"] > 0 and rate["bytes"] > 0

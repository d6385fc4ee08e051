"""Shared helpers of the engine tests: tiny random-weight hybrid models and the HF oracle.

Every model kind the engine serves is built here from its transformers config class with
explicit keyword arguments (nothing that only newer transformers releases infer), in fp32,
eval mode, with GQA on both layer kinds (``linear_num_value_heads = 2 * linear_num_key_heads``,
``num_key_value_heads < num_attention_heads``) and a mix of linear- and full-attention layers.

The correctness oracle is transformers' own ``model.generate(..., do_sample=False)`` run one
prompt at a time on the same weights (:func:`hf_greedy`). Outside an engine step a wrapped
model runs HF's code, so the oracle may run before, during or after ``wrap``.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

import hybrid_compile as hc

KINDS = ("qwen3_next_moe", "qwen3_next_dense", "qwen3_5", "qwen3_5_moe", "olmo_hybrid")

# Weights are drawn with a larger std than HF's default 0.02: with 0.02 a tiny random model
# collapses onto a two-token loop after a few steps, which would hide most state bugs; 0.2
# gives varied, context-dependent greedy continuations with clear top-1 margins.
INIT_STD = 0.2
MAX_POSITIONS = 512
PAD_TOKEN_ID = 0


@dataclass(frozen=True)
class KindSpec:
    hidden_size: int
    layer_types: tuple[str, ...]
    vocab_size: int


LIN, FULL = "linear_attention", "full_attention"
SPECS = {
    "qwen3_next_moe": KindSpec(32, (LIN, FULL, LIN, FULL), 160),
    "qwen3_next_dense": KindSpec(48, (LIN, LIN, FULL), 192),
    "qwen3_5": KindSpec(32, (FULL, LIN, LIN, FULL), 128),
    "qwen3_5_moe": KindSpec(64, (LIN, FULL, LIN), 256),
    "olmo_hybrid": KindSpec(32, (LIN, FULL, LIN), 128),
}


def _common_kwargs(spec: KindSpec) -> dict:
    n = len(spec.layer_types)
    return dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        num_hidden_layers=n,
        layer_types=list(spec.layer_types),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        max_position_embeddings=MAX_POSITIONS,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        initializer_range=INIT_STD,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        pad_token_id=PAD_TOKEN_ID,
        bos_token_id=None,
        eos_token_id=None,
    )


def make_config(kind: str):
    """The transformers config of one model kind (explicit kwargs only)."""
    import transformers

    spec = SPECS[kind]
    kw = _common_kwargs(spec)
    n = len(spec.layer_types)
    if kind == "qwen3_next_moe":
        return transformers.Qwen3NextConfig(
            **kw, intermediate_size=64, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
            moe_intermediate_size=32, shared_expert_intermediate_size=32, mlp_only_layers=[], norm_topk_prob=True,
        )
    if kind == "qwen3_next_dense":
        return transformers.Qwen3NextConfig(
            **kw, intermediate_size=64, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
            moe_intermediate_size=32, shared_expert_intermediate_size=32, mlp_only_layers=list(range(n)),
        )
    if kind == "qwen3_5":
        return transformers.Qwen3_5TextConfig(**kw, intermediate_size=64)
    if kind == "qwen3_5_moe":
        return transformers.Qwen3_5MoeTextConfig(
            **kw, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        )
    if kind == "olmo_hybrid":
        # beta = 2 * sigmoid(b): exercises the layer op's beta_scale (negative eigenvalues)
        return transformers.OlmoHybridConfig(**kw, intermediate_size=64, linear_allow_neg_eigval=True)
    raise KeyError(kind)


def model_class(kind: str):
    import transformers

    return {
        "qwen3_next_moe": transformers.Qwen3NextForCausalLM,
        "qwen3_next_dense": transformers.Qwen3NextForCausalLM,
        "qwen3_5": transformers.Qwen3_5ForCausalLM,
        "qwen3_5_moe": transformers.Qwen3_5MoeForCausalLM,
        "olmo_hybrid": transformers.OlmoHybridForCausalLM,
    }[kind]


def build_model(kind: str, seed: int = 0, config=None):
    """A tiny random-weight model of ``kind`` (fp32, eval); same (kind, seed) -> same weights."""
    config = make_config(kind) if config is None else config
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(kind)(config)
    model = model.float().eval()
    # no sampling / eos defaults leak into the oracle from the generation config
    model.generation_config.do_sample = False
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = PAD_TOKEN_ID
    return model


def vocab_size(model) -> int:
    return model.config.get_text_config().vocab_size


def random_prompts(lengths, vocab: int, seed: int) -> list[list[int]]:
    """Prompts of the given lengths with token ids in [1, vocab) (0 is the pad token)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


# ---------------------------------------------------------------------------------------------
# the oracle
# ---------------------------------------------------------------------------------------------


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos_token_id=None) -> list[int]:
    """HF ``generate(do_sample=False)`` on one unpadded prompt -> its new tokens (EOS included,
    nothing after it)."""
    ids = torch.tensor([prompt], dtype=torch.long, device=model.device)
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, min_new_tokens=0,
        do_sample=False, eos_token_id=eos_token_id, pad_token_id=PAD_TOKEN_ID,
    )
    return out[0, len(prompt):].tolist()


_hf_cache: dict = {}


def hf_greedy_cached(model, key, prompt: list[int], max_new_tokens: int, eos_token_id=None) -> list[int]:
    """:func:`hf_greedy`, memoised by ``key`` (identifies the weights, e.g. (kind, seed))."""
    k = (key, tuple(prompt), max_new_tokens, eos_token_id)
    if k not in _hf_cache:
        _hf_cache[k] = hf_greedy(model, prompt, max_new_tokens, eos_token_id)
    return list(_hf_cache[k])


@torch.inference_mode()
def hf_next_logits(model, tokens: list[int]) -> torch.Tensor:
    """HF's fp32 logits ``[V]`` for the token after ``tokens`` (one plain forward, no cache)."""
    ids = torch.tensor([tokens], dtype=torch.long)
    return model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits[0, -1].float()


def assert_metadata_equal(got, want) -> None:
    """Every field of two ``ForwardMetadata`` equal (tensors: same dtype and values)."""
    for f in dataclasses.fields(want):
        a, b = getattr(got, f.name), getattr(want, f.name)
        if isinstance(b, torch.Tensor):
            assert isinstance(a, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), f.name
        else:
            assert a == b, f.name


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where ``a`` and ``b`` differ (length difference counts)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def assert_greedy_equal(model, prompt: list[int], got: list[int], expected: list[int], what: str = "") -> None:
    """``got == expected`` (the HF greedy tokens), except that a divergence is accepted when HF's
    logits at that step have an exact tie between its top-2 tokens and the engine picked one of
    the tied tokens (argmax between exactly equal logits is arbitrary). Anything else fails."""
    i = first_divergence(got, expected)
    if i is None:
        return
    if i >= min(len(got), len(expected)):
        raise AssertionError(
            f"{what}: output lengths differ (engine {len(got)}, HF {len(expected)}):\n"
            f"  engine {got}\n  HF     {expected}"
        )
    logits = hf_next_logits(model, prompt + expected[:i])
    top = torch.topk(logits, 2)
    tied = set(torch.nonzero(logits == top.values[0]).flatten().tolist())
    if top.values[0] != top.values[1] or got[i] not in tied:
        raise AssertionError(
            f"{what}: engine diverges from HF greedy at new token {i} (engine {got[i]}, HF {expected[i]}); "
            f"HF top-2 logits {top.values.tolist()} at tokens {top.indices.tolist()} are not tied "
            f"(engine token's logit {logits[got[i]].item():.6f}):\n  engine {got}\n  HF     {expected}"
        )


# ---------------------------------------------------------------------------------------------
# engines
# ---------------------------------------------------------------------------------------------

# Small explicit capacities: the budget-derived defaults would size the pools from half of the
# host's RAM, which costs seconds (and gigabytes) per engine for these tiny models.
ENGINE_DEFAULTS = dict(max_total_tokens=2048, max_running_requests=8, mamba_cache_size=8, chunked_prefill_size=64)


class EngineStalled(AssertionError):
    pass


def _guard_against_stalls(engine, idle_limit: int = 3, tokenless_limit: int = 300) -> None:
    """Make ``engine.step`` raise instead of letting generate() spin forever: when it runs no
    forward while requests are unfinished (``idle_limit`` times in a row), or when
    ``tokenless_limit`` steps in a row produce no token (e.g. a leaked slot that makes the
    scheduler retract and re-admit the same request forever). Tests use prompts of at most
    200 tokens, so a healthy engine samples a token well within that many steps."""
    step = engine.step
    idle = [0, 0]

    def guarded_step():
        before = engine.stats()["steps"]
        out = step()
        ran = engine.stats()["steps"] != before
        idle[0] = 0 if ran or not engine.has_unfinished() else idle[0] + 1
        idle[1] = 0 if any(o.token is not None for o in out) or not engine.has_unfinished() else idle[1] + 1
        if idle[0] >= idle_limit or idle[1] >= tokenless_limit:
            raise EngineStalled(
                f"engine stalled: {idle[0]} steps without a forward, {idle[1]} without a token, with "
                f"requests unfinished (free {engine.pools.free_counts()}, used {engine.pools.used_counts()})"
            )
        return out

    engine.step = guarded_step


def make_engine(model, **overrides) -> "hc.HybridEngine":
    """``hc.wrap`` with small explicit capacities (``mamba_cache_size`` defaults to
    ``max_running_requests``) and a guard that turns a stalled engine into a failure."""
    kw = dict(ENGINE_DEFAULTS)
    kw.update(overrides)
    if "mamba_cache_size" not in overrides:
        kw["mamba_cache_size"] = kw["max_running_requests"]
    engine = hc.wrap(model, **kw)
    _guard_against_stalls(engine)
    return engine


def record_prefix_hits(engine) -> list[int]:
    """Record the hybrid hit length of every prefix-cache lookup of the engine's scheduler."""
    hits: list[int] = []
    match = engine.prefix_cache.match_prefix

    def recording_match(tokens):
        result = match(tokens)
        hits.append(result.prefix_len)
        return result

    engine.prefix_cache.match_prefix = recording_match
    return hits


def assert_pools_restored(engine, initial_free: dict) -> None:
    """Every pool slot is back: nothing leaked, free counts as right after ``wrap``. The prefix
    cache (on by default) keeps finished requests' slots: it is checked and emptied first."""
    if engine.prefix_cache is not None:
        engine.prefix_cache.check_invariants()
        engine.clear_prefix_cache()
    engine.pools.check_all_free()
    assert engine.pools.free_counts() == initial_free
    assert not engine.has_unfinished()


class RecordingStreamer:
    """A transformers-streamer stand-in (``put``/``end``) that records every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list | None]] = []

    def put(self, value) -> None:
        assert isinstance(value, torch.Tensor), f"streamer.put got {type(value).__name__}, not a tensor"
        self.calls.append(("put", value.detach().cpu().tolist()))

    def end(self) -> None:
        self.calls.append(("end", None))


@functools.lru_cache(maxsize=None)
def cached_model(kind: str, seed: int):
    """One model per (kind, seed) per test process (tests must close their engines)."""
    return build_model(kind, seed)


def single_threaded():
    """Generator for a module-scoped fixture: run torch on one intra-op thread, then restore.

    These models are tiny; with several threads on a busy 2-core machine each small op pays
    thread-pool synchronisation (measured ~10x slower), so the engine suites run single-threaded.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


STEP_INPUTS = ("input_ids", "positions", "logits_indices")


def record_graph_inputs(monkeypatch) -> list[list[tuple[str, tuple]]]:
    """Record every Dynamo graph our compile backend receives from now on: per graph, the
    ``(placeholder name, example shape)`` of its tensor inputs (a shape holds SymInts where Dynamo
    traced a size as symbolic)."""
    from hybrid_compile.compilation import backend as backend_module

    graphs: list[list[tuple[str, tuple]]] = []
    call = backend_module.HybridCompileBackend.__call__

    def recording(self, gm, example_inputs):
        graphs.append([(n.name, tuple(n.meta["example_value"].shape)) for n in gm.graph.nodes
                       if n.op == "placeholder" and isinstance(n.meta.get("example_value"), torch.Tensor)])
        return call(self, gm, example_inputs)

    monkeypatch.setattr(backend_module.HybridCompileBackend, "__call__", recording)
    return graphs


def symbolic_model_inputs(graph: list[tuple[str, tuple]]) -> list[tuple[str, tuple]]:
    """The inputs of a recorded graph (:func:`record_graph_inputs`) with a symbolic size other than the
    step's own (``STEP_INPUTS``): a weight or state traced so gets size symbols of its own, which makes
    otherwise identical layers' pieces distinct Inductor compiles (no FX-cache hit between them)."""
    return [(name, shape) for name, shape in graph
            if not all(isinstance(d, int) for d in shape) and not any(s in name for s in STEP_INPUTS)]

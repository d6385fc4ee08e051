"""Tiny local Hugging Face checkpoints for the loading / command-line tests (no download).

:func:`save_checkpoint` writes a random-weight model with ``save_pretrained(safe_serialization=
True)`` plus a tokenizer built here: a byte-level BPE trained with the ``tokenizers`` library on a
few sentences, wrapped as a ``PreTrainedTokenizerFast`` with bos / eos / pad tokens and a small
ChatML-like chat template, saved into the same directory. The model's vocabulary is exactly the
tokenizer's, and its config / generation config name the tokenizer's EOS, so greedy generation
stops where transformers' ``generate`` stops.

The oracle (:func:`hf_text`) loads the checkpoint with transformers' ``AutoModelForCausalLM`` and
``AutoTokenizer`` and decodes its greedy ``generate``.
"""

from __future__ import annotations

import functools
import pathlib

import torch

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Hybrid models mix full attention with linear attention and state space layers.",
    "Hello world! How are you today? I am fine, thank you.",
    "Gated delta networks keep a recurrent state per head.",
    "A small tokenizer for tests: numbers 0123456789 and punctuation , ; : ! ?",
]
BOS, EOS, PAD = "<|endoftext|>", "<|im_end|>", "<pad>"
SPECIAL_TOKENS = [BOS, "<|im_start|>", EOS, PAD]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VOCAB = 320
INIT_STD = 0.2  # varied greedy continuations (see engine_models.INIT_STD)


def build_tokenizer(vocab_size: int = VOCAB):
    """A byte-level BPE ``PreTrainedTokenizerFast`` of exactly ``vocab_size`` tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(SENTENCES * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD)
    fast.chat_template = CHAT_TEMPLATE
    assert len(fast) <= vocab_size, len(fast)
    return fast


def _qwen3_next(vocab: int, ids: dict):
    import transformers

    lin, full = "linear_attention", "full_attention"
    config = transformers.Qwen3NextConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=3, layer_types=[lin, full, lin],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
        num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, mlp_only_layers=[], norm_topk_prob=True, max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        initializer_range=INIT_STD, rms_norm_eps=1e-6, tie_word_embeddings=False, **ids,
    )
    return transformers.Qwen3NextForCausalLM(config)


def _mamba2(vocab: int, ids: dict):
    import transformers

    config = transformers.Mamba2Config(
        vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_heads=8, head_dim=8, expand=2, n_groups=2,
        state_size=16, conv_kernel=4, chunk_size=16, initializer_range=0.1, tie_word_embeddings=False, **ids,
    )
    return transformers.Mamba2ForCausalLM(config)


def _llama(vocab: int, ids: dict):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, **ids,
    )
    return transformers.LlamaForCausalLM(config)


BUILDERS = {"qwen3_next": _qwen3_next, "mamba2": _mamba2, "llama": _llama}


def save_checkpoint(directory, kind: str = "qwen3_next", seed: int = 0, tokenizer: bool = True) -> pathlib.Path:
    """Save a tiny random-weight ``kind`` model (safetensors) and, with ``tokenizer``, the test
    tokenizer into ``directory``; returns the directory."""
    directory = pathlib.Path(directory)
    tok = build_tokenizer()
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = BUILDERS[kind](VOCAB, ids).float().eval()
    model.generation_config.do_sample = False
    model.save_pretrained(directory, safe_serialization=True)
    if tokenizer:
        tok.save_pretrained(directory)
    return directory


@functools.lru_cache(maxsize=None)
def load_hf(directory: str):
    """transformers' own (model, tokenizer) of a saved checkpoint, fp32 on CPU."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(directory)


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The chat template's generation prompt, tokenized as transformers does it."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@torch.inference_mode()
def hf_text(directory: str, prompt, max_new_tokens: int) -> str:
    """Decoded greedy ``generate`` of transformers on ``prompt`` (a string, or chat messages)."""
    model, tok = load_hf(str(directory))
    ids = chat_prompt_ids(tok, prompt) if isinstance(prompt, list) else tok(prompt)["input_ids"]
    x = torch.tensor([ids])
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False)
    return tok.decode(out[0, len(ids):], skip_special_tokens=True)


def hf_chat(directory: str, user_messages: list[str], max_new_tokens: int, system: str | None = None) -> list[str]:
    """The replies of a conversation that resends the whole history each turn, via :func:`hf_text`."""
    messages = [{"role": "system", "content": system}] if system else []
    replies = []
    for text in user_messages:
        messages.append({"role": "user", "content": text})
        reply = hf_text(directory, list(messages), max_new_tokens)
        replies.append(reply)
        messages.append({"role": "assistant", "content": reply})
    return replies

"""A cache filled once and reused for more rows: GRPO's prompts' cache repeated for each prompt's samples, and
generation's shared prefix for each prompt. What the repetition must carry beyond attention's keys and values."""

from __future__ import annotations

import torch

# What RecurrentGemma keeps in its layers instead of the cache (its convolution's and RG-LRU's states, one row per
# sequence); with another number of rows its layers silently start again from zeros.
STATES_IN_LAYERS = ("conv1d_state", "recurrent_states")
# What a cache keeps beside its layers, one row per sequence: MiniMax's lightning-attention states (`MiniMaxCache`).
STATES_BESIDE_LAYERS = ("linear_cache",)


def empty_cache(model):
    """An empty cache for a first pass over prompts that `model` fills and the caller keeps: transformers'
    `DynamicCache`, or None where the model keeps a cache class of its own (MiniMax refuses any other), which it then
    builds and returns with its output (`cache_of`). RecurrentGemma needs one passed in: without one it starts its
    layers' states again and returns no cache. No communication."""
    from transformers import DynamicCache

    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # past peft's wrapper
    takes_dynamic = getattr(type(base), "_supports_default_dynamic_cache", None)  # what `generate` asks
    return None if takes_dynamic is not None and not takes_dynamic() else DynamicCache(config=model.config)


def cache_of(output, cache):
    """The cache a first pass filled: `cache`, the one passed in, or the one the model built (`empty_cache`)."""
    return output.past_key_values if cache is None else cache


def counts_its_tokens(cache, tokens: int) -> bool:
    """Does a filled cache say it holds its `tokens` tokens, so that `generate` continues after them? MiniMax's counts
    its first layer's, a linear one's: none, and `generate` would take it for empty; its caller reads them again."""
    return cache.get_seq_length() == tokens


def repeat_rows(model, cache, rows: int, repeats: int) -> None:
    """Repeat each of the `rows` rows of `cache` `repeats` times, in place: a prompt's cache for each of its samples,
    or a shared prefix's for each prompt. Through the beam-search reordering every layer kind has, the conv and
    recurrent states of linear-attention and state-space layers included: `batch_repeat_interleave` has none for
    them (transformers 5.23: "'LinearAttentionLayer' object has no attribute 'batch_repeat_interleave'", in GRPO's
    sampling of every hybrid: Qwen 3.5, LFM2, Jamba, Bamba, Granite 4, ...). The states that `model`'s layers keep
    themselves (`STATES_IN_LAYERS`), and the cache beside its layers (`STATES_BESIDE_LAYERS`), are repeated too. No
    communication."""
    index = torch.arange(rows).repeat_interleave(repeats)
    cache.reorder_cache(index)
    for name in STATES_BESIDE_LAYERS:
        states = getattr(cache, name, None)
        for i, state in enumerate(states if isinstance(states, list) else []):
            if isinstance(state, torch.Tensor) and state.shape[0] == rows:
                states[i] = state.index_select(0, index.to(state.device))
    for module in model.modules():
        for name in STATES_IN_LAYERS:
            state = getattr(module, name, None)
            if isinstance(state, torch.Tensor) and state.shape[0] == rows:
                setattr(module, name, state.repeat_interleave(repeats, dim=0))


def forget_rope_deltas(model) -> None:
    """Drop the rope offsets that Qwen-VL-style models (Qwen2-VL to Qwen 3.5, GLM-4V) keep from their last `generate`
    call, one row per sequence, and reuse when a call starts from a filled cache: GRPO's sampling, its cache filled
    by the prompts' pass, took the zero-shot evaluation's offsets (another number of rows) and failed ("The size of
    tensor a (32) must match the size of tensor b (2)"). For text they are zeros, computed again for this call. No
    communication."""
    for module in model.modules():
        if getattr(module, "rope_deltas", None) is not None:
            module.rope_deltas = None

"""Tiny causal LMs built from a config, no Hub: the families whose layers carry state along the row (recurrent,
convolutional, linear attention) or bias by place in it (ALiBi), and an attention-only one beside them."""

import torch

HYBRIDS = {
    "bamba": ("BambaConfig", "BambaForCausalLM", dict(attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16,
                                                      mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=8)),
    "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", dict(
        layer_types=["mamba", "attention"], mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1,
        mamba_chunk_size=8, num_local_experts=2, num_experts_per_tok=1, shared_intermediate_size=64)),
    "jamba": ("JambaConfig", "JambaForCausalLM", dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                                                      expert_layer_offset=1, num_experts=2, mamba_d_state=8)),
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM", dict(layer_types=["conv", "full_attention"])),
    "recurrent_gemma": ("RecurrentGemmaConfig", "RecurrentGemmaForCausalLM", dict(
        num_key_value_heads=1, lru_width=32, block_types=["recurrent", "attention"], attention_window_size=64)),
    "mpt (ALiBi)": ("MptConfig", "MptForCausalLM", dict(d_model=32, n_layers=2, n_heads=2, max_seq_len=64)),
    "qwen3 (attention only)": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16)),
}  # fmt: skip


def tiny_model(config_class, model_class, extra):
    """A 2-layer model of `config_class` (hidden 32, vocabulary 64 unless `extra` says), in eval mode, seeded."""
    import transformers

    sizes = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                 intermediate_size=64, vocab_size=64)  # fmt: skip
    torch.manual_seed(0)
    return getattr(transformers, model_class)(getattr(transformers, config_class)(**{**sizes, **extra})).eval()

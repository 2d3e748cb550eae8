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


# MiniMax: lightning (linear) attention beside full attention, in a cache class of its own that refuses any other.
MINIMAX = ("MiniMaxConfig", "MiniMaxForCausalLM", dict(
    head_dim=16, num_local_experts=2, num_experts_per_tok=1, layer_types=["linear_attention", "full_attention"],
    block_size=8))  # fmt: skip

# An MoE as transformers 5 keeps it: its experts fused into 3-D parameters (Mixtral, Qwen3-MoE, DeepSeek V3, ...).
FUSED_MOE = ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(head_dim=16, num_experts=4, num_experts_per_tok=2,
                                                           moe_intermediate_size=32))  # fmt: skip


# The text families users bring beyond those above (`make test-families`, tests/test_families.py), 2 layers, hidden 32.
TEXT_FAMILIES = {
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                                          layer_types=["sliding_attention", "full_attention"],
                                                          sliding_window=8)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=16, n_group=1, topk_group=1)),
    "qwen3_moe": FUSED_MOE,
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(head_dim=16, sliding_window=8)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(original_max_position_embeddings=128)),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(no_rope_layers=[1, 0])),
    "falcon_h1": ("FalconH1Config", "FalconH1ForCausalLM", dict(
        head_dim=16, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8, mamba_n_groups=1,
        mamba_chunk_size=8)),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", dict(head_dim=16)),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(head_dim=16, sliding_window=8)),
    "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM", dict(head_dim=16)),
    "exaone4": ("Exaone4Config", "Exaone4ForCausalLM", dict(head_dim=16, sliding_window=8)),
    "apertus": ("ApertusConfig", "ApertusForCausalLM", {}),
    "hunyuan_v1_dense": ("HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM", dict(head_dim=16)),
    "seed_oss": ("SeedOssConfig", "SeedOssForCausalLM", dict(head_dim=16)),
    "minimax": MINIMAX,
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        layer_types=["linear_attention", "full_attention"], linear_num_value_heads=2, linear_num_key_heads=2,
        linear_key_head_dim=8, linear_value_head_dim=8)),
    "zamba2": ("Zamba2Config", "Zamba2ForCausalLM", dict(
        mamba_d_state=8, mamba_headdim=8, n_mamba_heads=8, layers_block_type=["mamba", "hybrid"], num_mem_blocks=1,
        use_mem_rope=False)),
    # Older layouts, still fine-tuned: learned positions (GPT-2 and its Conv1D layers, OPT, StarCoder's GPT-BigCode),
    # ALiBi (BLOOM), partial rotary and fused QKV (GPT-NeoX, Phi), parallel attention with one KV head (Falcon), a
    # tied and scaled embedding (Gemma). Swept by hand with 7 more (GPT-J, StableLM, StarCoder2, Mistral, Cohere, OLMo,
    # Granite): every script passed.
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_embd=32, n_layer=2, n_head=2)),
    "opt": ("OPTConfig", "OPTForCausalLM", dict(ffn_dim=64, word_embed_proj_dim=32)),
    "gpt_bigcode": ("GPTBigCodeConfig", "GPTBigCodeForCausalLM", dict(n_embd=32, n_layer=2, n_head=2,
                                                                      multi_query=True)),
    "bloom": ("BloomConfig", "BloomForCausalLM", dict(n_layer=2, n_head=2)),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(rotary_pct=0.25)),
    "phi": ("PhiConfig", "PhiForCausalLM", dict(partial_rotary_factor=0.5)),
    "falcon": ("FalconConfig", "FalconForCausalLM", dict(new_decoder_architecture=False, multi_query=True,
                                                          parallel_attn=True, bias=False)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(head_dim=16)),
}  # fmt: skip


def save_with_tokenizer(family: tuple, tokenizer_dir, directory):
    """`tiny_model(*family)` sized to the tokenizer of `tokenizer_dir`, saved with it in `directory`."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config_class, model_class, extra = family
    tiny_model(config_class, model_class, {**extra, "vocab_size": len(tokenizer)}).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def tiny_model(config_class, model_class, extra):
    """A 2-layer model of `config_class` (hidden 32, vocabulary 64 unless `extra` says), in eval mode, seeded."""
    import transformers

    sizes = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                 intermediate_size=64, vocab_size=64)  # fmt: skip
    torch.manual_seed(0)
    return getattr(transformers, model_class)(getattr(transformers, config_class)(**{**sizes, **extra})).eval()


# Checkpoints that also read images, as their Hub repos hold them (tiny): Gemma 3 from 4B (transformers loads it whole
# as a causal LM), Mistral Small 3.x (an image-and-text model only), Llama 4 and Qwen 3.5 (a text-only causal LM too,
# which drops the vision tower; their checkpoints name the whole model). Each with its vision tower, its projector
# and an LM of 2 layers (hidden 32); Gemma 3's ties its LM head to the input embeddings, as every Gemma does.
_TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
             head_dim=16, max_position_embeddings=64)  # fmt: skip
_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
               patch_size=14)  # fmt: skip


def tiny_multimodal(family: str, vocab_size: int):
    """A tiny whole model of `family` ("gemma3", "mistral3", "llama4", "qwen3_5", "mllama", "phi4_multimodal"),
    seeded, its special image tokens the last ids of the vocabulary."""
    import transformers

    v = vocab_size
    torch.manual_seed(0)
    if family == "gemma3":
        config = transformers.Gemma3Config(
            text_config={**_TEXT, "vocab_size": v, "sliding_window": 8}, vision_config=_VISION,
            mm_tokens_per_image=4, image_token_index=v - 1, boi_token_index=v - 2, eoi_token_index=v - 3,
        )  # fmt: skip
        return transformers.Gemma3ForConditionalGeneration(config)
    if family == "mistral3":
        config = transformers.Mistral3Config(
            text_config={**_TEXT, "model_type": "mistral", "vocab_size": v, "tie_word_embeddings": False},
            vision_config={**_VISION, "head_dim": 16}, image_token_index=v - 1,
        )  # fmt: skip
        return transformers.Mistral3ForConditionalGeneration(config)
    if family == "qwen3_5":  # Gated DeltaNet and attention layers, multimodal RoPE
        text = {**_TEXT, "vocab_size": v, "layer_types": ["linear_attention", "full_attention"],
                "linear_num_value_heads": 2, "linear_num_key_heads": 2, "linear_key_head_dim": 8,
                "linear_value_head_dim": 8}  # fmt: skip
        vision = dict(depth=1, hidden_size=32, out_hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14)
        config = transformers.Qwen3_5Config(
            text_config=text, vision_config=vision, image_token_id=v - 1, video_token_id=v - 2,
            vision_start_token_id=v - 3, vision_end_token_id=v - 4,
        )  # fmt: skip
        return transformers.Qwen3_5ForConditionalGeneration(config)
    if family == "mllama":  # Llama 3.2 Vision: a cross-attention layer among the decoder's, run only beside an image
        text = {**_TEXT, "vocab_size": v, "num_hidden_layers": 3, "cross_attention_layers": [1], "bos_token_id": 1,
                "eos_token_id": 2, "pad_token_id": 0}  # fmt: skip
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_global_layers=1, attention_heads=2,
                      image_size=28, patch_size=14, vision_output_dim=32, intermediate_layers_indices=[0])  # fmt: skip
        config = transformers.MllamaConfig(text_config=text, vision_config=vision, image_token_index=v - 1)
        return transformers.MllamaForConditionalGeneration(config)
    if family == "phi4_multimodal":  # its vision and audio towers inside the decoder, beside its embeddings
        text = {key: value for key, value in _TEXT.items() if key != "head_dim"}
        vision = dict(_VISION, crop_size=28, image_token_id=v - 1)
        audio = dict(hidden_size=32, intermediate_size=64, num_blocks=1, num_attention_heads=2, ext_pw_out_channel=32,
                     depthwise_separable_out_channel=32, nemo_conv_channels=32, audio_token_id=v - 2)  # fmt: skip
        config = transformers.Phi4MultimodalConfig(
            **text, vocab_size=v, bos_token_id=1, eos_token_id=2, pad_token_id=0, original_max_position_embeddings=64,
            vision_config=vision, audio_config=audio,
        )  # fmt: skip
        return transformers.Phi4MultimodalForCausalLM(config)
    vision = dict(_VISION, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32)
    text = {**_TEXT, "vocab_size": v, "num_local_experts": 2, "intermediate_size_mlp": 64}  # a MoE layer each
    config = transformers.Llama4Config(text_config=text, vision_config=vision, image_token_index=v - 1)
    return transformers.Llama4ForConditionalGeneration(config)


def save_multimodal(family: str, tokenizer_dir, directory):
    """`tiny_multimodal(family)` saved in `directory` with the tokenizer of `tokenizer_dir`; Gemma 3's with its
    processor too (Gemma3Processor: an image processor for 28-pixel images, and the tokenizer with Gemma's image
    tokens), as Gemma 3's repos hold one."""
    import transformers
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    # Qwen 3.5's tokenizer class adds its own end-of-text token, read from this directory: room for it
    tiny_multimodal(family, len(tokenizer) + (8 if family == "qwen3_5" else 0)).save_pretrained(directory)
    if family != "gemma3":
        tokenizer.save_pretrained(directory)
        return directory
    with_image_tokens = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer.backend_tokenizer, bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token,
        unk_token=tokenizer.unk_token, model_max_length=tokenizer.model_max_length,
        extra_special_tokens={"boi_token": tokenizer.eos_token, "eoi_token": tokenizer.eos_token,
                              "image_token": tokenizer.unk_token},
    )  # fmt: skip
    with_image_tokens.chat_template = tokenizer.chat_template
    images = transformers.Gemma3ImageProcessorPil(size={"height": 28, "width": 28})
    processor = transformers.Gemma3Processor(image_processor=images, tokenizer=with_image_tokens, image_seq_length=4)
    processor.save_pretrained(directory)
    return directory

"""Causal language models: loading, conversations, training rows, DPO, GRPO, generation, LoRA, QLoRA, GGUF.

- causal_lm.py        load_causal_lm, the collator, the causal-LM loss, perplexity
- token_blocks.py     raw text cut into blocks, examples packed into rows: the same whatever processes prepare them
- chat.py             conversations rendered by the chat template; the assistant-only targets; end-of-turn tokens
- sft_formats.py      SFT data in the shapes users bring (chat, Alpaca, ShareGPT, prompt/completion), each record read
- sft_data.py         SFT records as training rows: labels on what is learned, cut to the block, packed
- turns.py            ShareGPT turns and tool calls (OpenAI's, LLaMA-Factory's) as the turns and tools templates render;
                      the checks every record's turns pass
- pair_formats.py     preference pairs in the shapes users bring (per split), each record read and checked
- preference_data.py  preference pairs tokenized as training rows, the same way on both sides
- pair_batches.py     a batch of pairs: a pair as one row (its prompt computed once), or as two
- pair_scoring.py     both sides of a pair in one forward pass, and the probe that refuses where it is not exact
- dpo.py              the DPO, IPO and SimPO losses; the reference without a second model; preference evaluation
- generation.py       answers by greedy generation, scored; the shared prompt prefix computed once
- cache_rows.py       a first pass's cache, of the model's own class; repeated for more rows (GRPO's samples)
- grpo.py             GRPO: completions sampled by (seed, step, prompt), rewards, advantages, the clipped loss
- grpo_data.py        GRPO's prompts: tokenized, fitted with their answers in the context, batched on the left
- grpo_log.py         what GRPO's log shows: generation's share, rewards, groups without signal, lengths
- group_scoring.py    a group's completions scored in one pass: one row per prompt, or a row per completion
- static_decoding.py  GRPO's --compile_generation: a static KV cache kept across steps, the decoding step compiled
- lora.py             LoRA set-up, --lora_last_layers, an MoE's fused experts
- lora_merge.py       the model saved with merged/, merged copies for generation
- quantized.py        QLoRA (--load_in_4bit): the base in 4-bit NF4 (bitsandbytes), merged/ from unquantized weights
- classifier_lora.py  LoRA for train.py's and train_image.py's classifiers (QLoRA: text): body adapted, head whole
- multimodal.py       a model that also reads images, trained on text: what text never runs, frozen; its processor
- weight_reads.py     code that reads layers' weights without calling them: no adapter; ZeRO-3 gathers them (peft's too)
- gguf.py             GGUF checkpoints dequantized once into a cache

Knows nothing of a script's start or options parsing: imports core, data, checkpoints, training and results.
"""

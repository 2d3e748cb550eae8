"""Checkpoints that also read images, fine-tuned on text (ddp_utils/language_models/multimodal.py): Gemma 3 from 4B,
which transformers loads whole as a causal LM; Mistral Small 3.x, an image-and-text model only; Llama 4, whose
checkpoint names the whole model. What users rely on:

- the run trains on 2 processes, full or LoRA, where it stopped before (Gemma 3: at `add_lora`, or under DDP at the
  second step, waiting for the vision tower's gradients; Mistral 3: refused with 200 class names; Llama 4: LoRA on
  its router, "'tuple' object has no attribute 'dtype'");
- the vision tower and projector are saved as loaded, bit for bit, the image processor with them, and the result
  reloads as the same whole model, so it still reads images; LoRA adapts the language model only;
- the model card's loading code loads it."""

import json
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from model_families import save_multimodal, tiny_model, tiny_multimodal
from safetensors.numpy import load_file

from conftest import REPO, launch, make_tiny_causal_lm, sft_args

TRAIN_SFT = REPO / "scripts" / "train_sft.py"
VISION = ("vision_tower.", "vision_model.", "multi_modal_projector.", "embed_tokens_extend.")


def lora_args(targets="all-linear", last_layers=0):
    return SimpleNamespace(
        lora_r=4, lora_alpha=8, lora_dropout=0.0, lora_target_modules=targets, lora_last_layers=last_layers, seed=0
    )


def adapted(model) -> set[str]:
    return {name for name, module in model.named_modules() if hasattr(module, "lora_A")}


@pytest.mark.fast
def test_what_text_never_runs_is_frozen_left_without_adapters_and_the_class_loads_the_whole_model(tmp_path):
    import transformers
    from accelerate import PartialState

    from ddp_utils import UsageError
    from ddp_utils.language_models.lora import add_lora
    from ddp_utils.language_models.multimodal import freeze_parts_text_never_runs
    from ddp_utils.training.pretrained import causal_lm_class

    PartialState(cpu=True)  # they log through Accelerate
    untouched = {
        "gemma3": ["model.vision_tower", "model.multi_modal_projector"],
        "mistral3": ["model.vision_tower", "model.multi_modal_projector"],
        "llama4": ["vision_model", "multi_modal_projector"],
        "qwen3_5": ["model.visual"],
        "mllama": ["model.vision_model", "model.multi_modal_projector", "model.language_model.layers.1"],
        "phi4_multimodal": ["model.embed_tokens_extend"],  # inside the decoder: nothing was frozen
    }
    loads_with = {"gemma3": "AutoModelForCausalLM", "mistral3": "AutoModelForImageTextToText",
                  "llama4": "AutoModelForImageTextToText", "qwen3_5": "AutoModelForImageTextToText",
                  "mllama": "AutoModelForImageTextToText", "phi4_multimodal": "AutoModelForCausalLM"}  # fmt: skip
    for family, parts in untouched.items():
        model = tiny_multimodal(family, 64)
        assert freeze_parts_text_never_runs(model) == parts
        frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
        assert frozen == {name for name, _ in model.named_parameters() if name.startswith(tuple(parts))}
        model.save_pretrained(tmp_path / family)  # its config now names the whole model, as a Hub checkpoint's does
        config = transformers.AutoConfig.from_pretrained(tmp_path / family)
        assert causal_lm_class(config).__name__ == loads_with[family], family
        for targets in ("all-linear", "qkv_proj" if family == "phi4_multimodal" else "q_proj,v_proj"):  # Phi's fused
            names = adapted(add_lora(tiny_multimodal(family, 64), lora_args(targets)))
            assert names and not [name for name in names if any(part in name for part in VISION)], (family, targets)
    roberta = dict(is_decoder=True, max_position_embeddings=64)  # its LM head has a transform of its own: text runs it
    for text_only in (tiny_model("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16)),
                      tiny_model("RobertaConfig", "RobertaForCausalLM", roberta)):  # fmt: skip
        assert freeze_parts_text_never_runs(text_only) == [] and all(p.requires_grad for p in text_only.parameters())

    # Text runs every weight left to train: each takes a gradient from text alone (under DDP, one that does not
    # stopped the run at its second step; Mllama's cross-attention layer did).
    for family in untouched:
        model = tiny_multimodal(family, 64)
        freeze_parts_text_never_runs(model)
        model(input_ids=torch.tensor([[1, 5, 9, 3]]), labels=torch.tensor([[1, 5, 9, 3]])).loss.backward()
        idle = [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None]
        assert idle == [], (family, idle[:3])

    # Llama 4's and PhiMoE's routers return their scores and choices: no adapter there, and naming one is refused.
    phimoe = tiny_model("PhimoeConfig", "PhimoeForCausalLM", dict(num_local_experts=2, num_experts_per_tok=2))
    assert adapted(add_lora(phimoe, lora_args())) and not [n for n in adapted(phimoe) if n.endswith("router")]
    llama4 = add_lora(tiny_multimodal("llama4", 64), lora_args())
    assert not [name for name in adapted(llama4) if name.endswith("router")]
    llama4(input_ids=torch.tensor([[1, 5, 9, 3]]), labels=torch.tensor([[1, 5, 9, 3]])).loss.backward()
    with pytest.raises(UsageError, match=r"^--lora_target_modules names router, a Llama4Router whose output is sev"):
        add_lora(tiny_multimodal("llama4", 64), lora_args("q_proj,router"))


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    tokenizer = make_tiny_causal_lm(tmp_path_factory.mktemp("llama"), chat_template=True)
    return save_multimodal("gemma3", tokenizer, tmp_path_factory.mktemp("gemma3"))


def test_gemma3_trains_on_text_on_two_processes_resumes_bit_for_bit_and_still_reads_images(gemma3, sft_data, tmp_path):
    """Full fine-tuning, DDP, the defaults: before, the run stopped at its second step ("Expected to have finished
    reduction ...": the vision tower took no gradient). The tower and projector come back bit for bit, the language
    model trained, and the output loads as Gemma 3's whole model with its processor. Its checkpoints leave the frozen
    tower out, and a run resumed from one equals the uninterrupted run to the bit."""
    import shutil

    from transformers import AutoModelForCausalLM, AutoProcessor

    args = sft_args(gemma3, sft_data, tmp_path / "run", "--max_train_steps", 4)
    args[args.index("--checkpointing_steps") + 1] = 2
    run = launch(TRAIN_SFT, *args)
    assert run.returncode == 0, run.output[-3000:]
    assert "text never runs ['model.vision_tower', 'model.multi_modal_projector']" in run.output
    before, after = load_file(str(gemma3 / "model.safetensors")), load_file(str(tmp_path / "run" / "model.safetensors"))
    assert sorted(before) == sorted(after)
    vision = [key for key in before if key.startswith(VISION)]
    assert vision and all(np.array_equal(before[key], after[key]) for key in vision)
    trained = [key for key in before if key.endswith("proj.weight") and key not in vision]
    assert trained and all(not np.array_equal(before[key], after[key]) for key in trained)
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path / "run")).__name__ == "Gemma3ForConditionalGeneration"
    assert type(AutoProcessor.from_pretrained(tmp_path / "run")).__name__ == "Gemma3Processor"
    assert "pipeline_tag: image-text-to-text" in (tmp_path / "run" / "README.md").read_text()

    checkpoint = load_file(str(tmp_path / "run" / "checkpoint-2" / "model.safetensors"))
    assert checkpoint and not [key for key in checkpoint if "vision" in key or "multi_modal" in key]
    shutil.copytree(tmp_path / "run" / "checkpoint-2", tmp_path / "resumed" / "checkpoint-2")
    args[args.index("--output_dir") + 1] = tmp_path / "resumed"
    assert launch(TRAIN_SFT, *args, "--resume_from_checkpoint", "latest").returncode == 0
    resumed = load_file(str(tmp_path / "resumed" / "model.safetensors"))
    assert [key for key in after if not np.array_equal(resumed[key], after[key])] == [], "not bit for bit"


def test_gemma3_lora_adapts_the_language_model_and_merges_into_the_whole_model(gemma3, sft_data, tmp_path):
    """Before, `add_lora` stopped on Gemma 3's config ("no attribute 'num_hidden_layers'"); peft's `all-linear` alone
    puts adapters on the vision tower too, which never train. The merged model computes what base + adapter does."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoProcessor

    output_dir = tmp_path / "lora"
    run = launch(
        TRAIN_SFT, *sft_args(gemma3, sft_data, output_dir, "--max_train_steps", 3, "--lora_r", 4, "--merge_lora")
    )
    assert run.returncode == 0, run.output[-3000:]
    adapter = load_file(str(output_dir / "adapter_model.safetensors"))
    assert adapter and all(".language_model." in key for key in adapter), sorted(adapter)[:3]
    ids = torch.tensor([[1, 27, 18, 40, 41, 42]])
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(gemma3).eval()
        merged = AutoModelForCausalLM.from_pretrained(output_dir / "merged").eval()
        expected = PeftModel.from_pretrained(base, output_dir).eval()(input_ids=ids).logits
        torch.testing.assert_close(merged(input_ids=ids).logits, expected, atol=1e-5, rtol=0)
    assert type(merged).__name__ == "Gemma3ForConditionalGeneration"
    assert type(AutoProcessor.from_pretrained(output_dir / "merged")).__name__ == "Gemma3Processor"


def test_mistral3_loads_as_an_image_and_text_model_and_its_card_loads_the_adapter(sft_data, tmp_path):
    """Before, transformers' AutoModelForCausalLM refused Mistral 3 with a list of 200 classes. The model card's
    loading code (peft's AutoPeftModelForCausalLM cannot load such a base) is run as a user would run it."""
    tokenizer = make_tiny_causal_lm(tmp_path / "llama", chat_template=True)
    mistral3 = save_multimodal("mistral3", tokenizer, tmp_path / "mistral3")
    output_dir = tmp_path / "lora"
    run = launch(TRAIN_SFT, *sft_args(mistral3, sft_data, output_dir, "--max_train_steps", 2, "--lora_r", 4))
    assert run.returncode == 0, run.output[-3000:]
    card = (output_dir / "README.md").read_text()
    code = re.search(r"## How to load it\n\n```python\n(.*?)```", card, re.S).group(1)
    assert "AutoModelForImageTextToText" in code
    namespace = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path)  # the card names the model by its repository's name, here the output directory's
        exec(code, namespace)
    assert type(namespace["model"].get_base_model()).__name__ == "Mistral3ForConditionalGeneration"
    assert json.loads((output_dir / "adapter_config.json").read_text())["exclude_modules"]


def test_grpo_samples_and_trains_qwen3_5_whole(tmp_path):
    """Qwen 3.5 (Gated DeltaNet layers beside attention, multimodal RoPE; its checkpoint names the whole model): GRPO
    stopped at its first sampling twice over, on its linear-attention cache, whose rows `batch_repeat_interleave`
    cannot repeat, and then on the RoPE offsets its last `generate` kept, of the zero-shot evaluation's rows."""
    from test_grpo import grpo_args, write_prompts

    tokenizer = make_tiny_causal_lm(tmp_path / "llama", chat_template=True)
    qwen = save_multimodal("qwen3_5", tokenizer, tmp_path / "qwen3_5")
    output_dir = tmp_path / "grpo"
    run = launch(
        REPO / "scripts" / "train_grpo.py",
        *grpo_args(qwen, write_prompts(tmp_path), output_dir, "--max_train_steps", 2),
    )
    assert run.returncode == 0, run.output[-3000:]
    assert "text never runs ['model.visual']" in run.output
    adapter = load_file(str(output_dir / "adapter_model.safetensors"))
    assert adapter and all(".language_model." in key for key in adapter), sorted(adapter)[:3]

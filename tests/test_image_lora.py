"""LoRA for scripts/train_image.py's image classifiers (--lora_r). What users rely on:

- on every image family users bring (`image_families`), the adapters sit on the pretrained body and the head the
  task adds trains whole; the saved adapter reloads with the model card's code (the labels saved beside it) and
  computes what was trained; a family with BatchNorm is refused in one line (its running statistics move in
  training and a LoRA adapter does not hold them), a convolutional one without linear layers (PoolFormer, BiT) is
  told to name its convolutions, and then trains, but for BiT's weight-standardized ones, which are refused;
- 2 processes and 1 with accumulation train the same adapter and head (LoRA dropout on, as by default), a resumed
  run ends bit for bit as an uninterrupted one, and --merge_lora's model loads in an image-classification pipeline
  and computes what the base with the adapter computes; FSDP2 and ZeRO-3 on CPU processes train DDP's adapter;
- the demo, trained from scratch, refuses --lora_r."""

import shutil

import numpy as np
import pytest
import torch
from image_families import IMAGE_FAMILIES, SIZE, has_batchnorm, make_family_model
from safetensors.numpy import load_file
from test_classifier_lora import assert_same_lora
from test_image import TRAIN_IMAGE, image_args, write_image_folder

from conftest import launch, launch_sharded, load_script

HEADS = {"deit_distilled": ["cls_classifier", "distillation_classifier"]}  # the others': classifier
CONVOLUTIONAL = ("poolformer", "bit")  # no linear layer in the body: their convolutions named instead
UNUSED = {"siglip": "vision_model.head."}  # its attention-pooling head, which its classifier does not run


def card_code(output_dir) -> str:
    card = (output_dir / "README.md").read_text()
    return card.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.parametrize("family", list(IMAGE_FAMILIES))
def test_every_family_trains_adapters_on_its_body_and_its_head_whole_and_the_card_reloads_it(family, tmp_path):
    from accelerate import Accelerator
    from transformers import AutoConfig, AutoImageProcessor, AutoModelForImageClassification

    import ddp_utils
    from ddp_utils import UsageError
    from ddp_utils.results.model_card import write_model_card
    from ddp_utils.results.output import write_pretrained

    Accelerator(cpu=True)
    source = make_family_model(family, tmp_path / family)  # a 5-class head: 3 classes make it new
    config = AutoConfig.from_pretrained(source, **ddp_utils.label_config(["dark", "bright", "striped"]))
    model = ddp_utils.load_pretrained(AutoModelForImageClassification, str(source), config=config,
                                      ignore_mismatched_sizes=True)  # fmt: skip
    flags = ["--model_name_or_path", str(source), "--lora_r", "4", "--output_dir", str(tmp_path / "out")]
    args = load_script("train_image").parse_args(flags)
    if has_batchnorm(family):
        with pytest.raises(UsageError, match=r"^--lora_r: \w+ has BatchNorm \(\d+ layers, e\.g\. .*\), whose running "
                                             r"statistics move in training but are not saved in a LoRA adapter; "
                                             r"train it whole, without --lora_r$"):  # fmt: skip
            ddp_utils.add_classifier_lora(model, args)
        return
    if family in CONVOLUTIONAL:
        with pytest.raises(UsageError, match=r"finds no linear layer in .* name its convolutions, \['conv"):
            ddp_utils.add_classifier_lora(model, args)
        args = load_script("train_image").parse_args([*flags, "--lora_target_modules", "conv1,conv2"])
    if family == "bit":  # weight-standardized, padded convolutions: an adapter beside them computes something else
        with pytest.raises(UsageError, match=r"conv1 is a WeightStandardizedConv2d, which computes otherwise than a "
                                             r"plain convolution, so a LoRA adapter cannot follow it"):  # fmt: skip
            ddp_utils.add_classifier_lora(model, args)
        return
    model = ddp_utils.add_classifier_lora(model, args)
    trainable = [name.removeprefix("base_model.model.") for name, p in model.named_parameters() if p.requires_grad]
    whole = {name.split(".modules_to_save.")[0] for name in trainable if ".modules_to_save." in name}
    assert sorted(whole) == HEADS.get(family, ["classifier"]) and any("lora_A" in name for name in trainable)
    assert all(("lora_" in name) != (".modules_to_save." in name) for name in trainable)

    vision = getattr(model.config, "vision_config", model.config)  # CLIP's and SigLIP's sizes are there
    torch.manual_seed(0)
    pixels = torch.randn(3, vision.num_channels, SIZE, SIZE)
    with torch.no_grad():  # B starts at zero: a forward would not tell the adapter was loaded
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.1)
    model.train()
    torch.nn.functional.cross_entropy(model(pixel_values=pixels).logits, torch.tensor([0, 1, 2])).backward()
    unused = UNUSED.get(family, "-")
    no_gradient = [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert [name for name in no_gradient if f".{unused}" not in name] == []
    model.eval()
    with torch.no_grad():
        trained = model(pixel_values=pixels).logits
    output_dir = tmp_path / "out"
    write_pretrained(model, model.state_dict(), str(output_dir), AutoImageProcessor.from_pretrained(source))
    write_model_card(args, {})
    assert "pipeline_tag: image-classification" in (output_dir / "README.md").read_text()
    loaded = {}
    exec(card_code(output_dir).replace('"out"', repr(str(output_dir))), loaded)  # the card's own lines
    with torch.no_grad():
        torch.testing.assert_close(loaded["model"].eval()(pixel_values=pixels).logits, trained)
    assert loaded["model"].config.id2label[2] == "striped" and loaded["image_processor"] is not None


def test_the_demo_trained_from_scratch_refuses_lora():
    from ddp_utils import UsageError

    with pytest.raises(UsageError, match=r"^--lora_r adapts a pretrained model; the demo trains from scratch"):
        load_script("train_image").parse_args(["--lora_r", "4"])


def adapter(output_dir) -> dict:
    return load_file(str(output_dir / "adapter_model.safetensors"))


def test_lora_trains_the_same_image_classifier_on_any_layout_resumes_bit_for_bit_and_merges(tmp_path):
    """A tiny ViT with LoRA's default dropout: 2 processes and 1 process, each accumulating micro-batches of 2 to the
    global batch of 8, train the same adapter and head; a run resumed from its step-3 checkpoint ends bit for bit as
    the uninterrupted one; the merged model loads in an image-classification pipeline and computes what the base with
    the adapter computes."""
    from peft import PeftModel
    from PIL import Image
    from transformers import AutoConfig, AutoImageProcessor, AutoModelForImageClassification, pipeline

    images = {
        "train": write_image_folder(tmp_path / "train", {"dark": 6, "bright": 5, "striped": 5}, seed=1),
        "validation": write_image_folder(tmp_path / "validation", {"dark": 2, "bright": 2, "striped": 2}, seed=2),
    }
    source = make_family_model("vit", tmp_path / "vit")
    steps = ["--max_train_steps", 6, "--checkpointing_steps", 3, "--lora_r", 4, "--per_device_train_batch_size", 2,
             "--global_batch_size", 8]  # fmt: skip
    two, one = tmp_path / "two", tmp_path / "one"
    run = launch(TRAIN_IMAGE, *image_args(source, images, two, *steps, "--merge_lora"))
    assert run.returncode == 0, run.output[-3000:]
    assert "LoRA: classifier trains whole, with no adapter (it holds weights the checkpoint lacks)" in run.output
    assert launch(TRAIN_IMAGE, *image_args(source, images, one, *steps), num_processes=1).returncode == 0
    ours, theirs = adapter(one), adapter(two)
    assert sorted(ours) == sorted(theirs) and any("classifier" in key for key in ours)
    assert all(np.abs(value).max() > 0 for key, value in ours.items() if "lora_B" in key)  # B starts at 0: it moved
    for key in theirs:
        np.testing.assert_allclose(ours[key], theirs[key], rtol=1e-5, atol=1e-6, err_msg=key)

    resumed = tmp_path / "resumed"
    shutil.copytree(two / "checkpoint-3", resumed / "checkpoint-3")
    run = launch(TRAIN_IMAGE, *image_args(source, images, resumed, *steps, "--resume_from_checkpoint", "latest"))
    assert run.returncode == 0 and "resumed from" in run.output, run.output[-3000:]
    assert [key for key, value in adapter(resumed).items() if not np.array_equal(value, theirs[key])] == []

    image = Image.open(next((images["validation"] / "striped").iterdir())).convert("RGB")
    pixels = AutoImageProcessor.from_pretrained(two)(image, return_tensors="pt")["pixel_values"]
    base = AutoModelForImageClassification.from_pretrained(source, config=AutoConfig.from_pretrained(two),
                                                           ignore_mismatched_sizes=True)  # fmt: skip
    expected = PeftModel.from_pretrained(base, two).eval()
    merged = AutoModelForImageClassification.from_pretrained(two / "merged").eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(pixels).logits, expected(pixel_values=pixels).logits, rtol=1e-5, atol=1e-5)
    answer = pipeline("image-classification", model=str(two / "merged"), device="cpu")(image)
    assert {row["label"] for row in answer} == {"dark", "bright", "striped"}


@pytest.mark.parametrize("sharded", ["fsdp", "zero3"])
def test_lora_trains_the_image_classifier_under_fsdp2_and_zero3_as_ddp_does(sharded, tmp_path):
    """On 2 CPU processes under Accelerate's FSDP2 path (rank 0 alone reads the weights and tells the others which
    ones the checkpoint lacked) and under DeepSpeed ZeRO-3 (the model built in shards): the same adapter and head as
    DDP's, LoRA's dropout on, and the same merged model (measured 0.0 and 7.5e-9 apart)."""
    images = {
        "train": write_image_folder(tmp_path / "train", {"dark": 6, "bright": 5, "striped": 5}, seed=1),
        "validation": write_image_folder(tmp_path / "validation", {"dark": 2, "bright": 2, "striped": 2}, seed=2),
    }
    source = make_family_model("vit", tmp_path / "vit")
    args = ["--max_train_steps", 4, "--lora_r", 4, "--per_device_train_batch_size", 4, "--merge_lora"]
    ddp, other = tmp_path / "ddp", tmp_path / sharded
    assert launch(TRAIN_IMAGE, *image_args(source, images, ddp, *args)).returncode == 0
    launch_sharded(sharded, "train_image", *image_args(source, images, other, *args))
    assert_same_lora(other, ddp)

"""--gradient_checkpointing in train.py and train_image.py (`ddp_utils.checkpoint_if_asked`), for models whose
activations outgrow the GPU. What users rely on, with dropout and stochastic depth on as the families have them:

- on every text family (`classifier_families`) with LoRA, and every image family (`image_families`) trained whole,
  each trainable weight gets the gradient it gets without checkpointing (the recomputation draws the forward pass's
  random masks again), and no hook makes the embeddings' output require a gradient (peft adds one, which only
  reentrant checkpointing needs);
- a family transformers cannot checkpoint (ALBERT, MPNet, ConvNeXt, ...) is refused in one line, and so is one whose
  checkpointed layers hold BatchNorm (MobileViT): recomputed, it would update its running statistics twice a step;
- each script on 2 processes trains the same model with it as without, and the log says it checkpointed."""

import argparse

import numpy as np
import pytest
import torch
import transformers
from classifier_families import FAMILIES, save_family
from image_families import IMAGE_FAMILIES, make_family_model
from safetensors.numpy import load_file
from test_image import TRAIN_IMAGE, image_args, write_image_folder

from conftest import REPO, launch, load_script, make_tiny_model, train_args

TRAIN = REPO / "scripts" / "train.py"
TEXTS = ["great", "the movie was very bad", "it is a really quite plain film this okay"]
CHECKPOINTED = "each layer's activations recomputed in the backward pass"


def gradients(model) -> dict:
    return {name: p.grad for name, p in model.named_parameters() if p.requires_grad}


def assert_same_gradients(plain: dict, checkpointed: dict) -> None:
    """The same gradients, and none missing but where the plain pass has none too (DINOv2's mask token, CLIP's and
    SigLIP's unused pooling: parameters off the logits). Equal within 1e-5 of the tensor's largest entry (or rtol
    1e-5): with its layers recomputed, T5's came out up to 1e-6 of that apart on an AVX-512 CPU (bit for bit on the
    CPUs before), which failed its small entries at rtol 1e-5 alone; a wrong gradient is far further off."""
    assert sorted(plain) == sorted(checkpointed)
    assert [name for name, g in checkpointed.items() if g is None] == [name for name, g in plain.items() if g is None]
    for name, grad in plain.items():
        if grad is not None:
            scale = grad.abs().max().item()
            torch.testing.assert_close(checkpointed[name], grad, rtol=1e-5, atol=max(1e-5 * scale, 1e-7), msg=name)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_text_family_gets_with_lora_the_gradients_it_gets_without(family, tmp_path):
    from accelerate import Accelerator
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    import ddp_utils
    from ddp_utils import UsageError

    Accelerator(cpu=True)
    source = save_family(family, tmp_path / family)
    config = AutoConfig.from_pretrained(source, num_labels=3)
    config.pad_token_id = config.pad_token_id if config.pad_token_id is not None else config.eos_token_id
    tokenizer = AutoTokenizer.from_pretrained(source)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    batch = tokenizer(TEXTS, padding=True, return_tensors="pt")

    def trained_once(checkpointing: bool) -> dict:
        flags = ["--model_name_or_path", str(source), "--lora_r", "4", "--seed", "0"]
        args = load_script("train").parse_args(flags + (["--gradient_checkpointing"] if checkpointing else []))
        torch.manual_seed(0)  # the same new head
        model = ddp_utils.load_pretrained(AutoModelForSequenceClassification, str(source), config=config)
        ddp_utils.checkpoint_if_asked(model, args)
        model = ddp_utils.add_classifier_lora(model, args)
        assert model.get_base_model().is_activation_checkpointing == checkpointing
        assert not model.get_input_embeddings()._forward_hooks, "no hook makes the embeddings' output require grad"
        with torch.no_grad():  # B starts at zero: the adapters' A would get no gradient
            for name, parameter in model.named_parameters():
                if "lora_B" in name:
                    parameter.normal_(std=0.1)
        model.train()
        torch.manual_seed(1)  # the same dropout masks
        torch.nn.functional.cross_entropy(model(**batch).logits, torch.tensor([0, 1, 2])).backward()
        return gradients(model)

    if family in ("albert", "mpnet"):
        with pytest.raises(UsageError, match=r"^--gradient_checkpointing: .* cannot recompute its activations in "
                                             r"transformers .*; drop it, or lower --per_device_"):  # fmt: skip
            trained_once(checkpointing=True)
        return
    checkpointed = trained_once(True)
    assert any(g.abs().max() > 0 for name, g in checkpointed.items() if "lora_A" in name)
    assert_same_gradients(trained_once(False), checkpointed)


@pytest.mark.parametrize("family", list(IMAGE_FAMILIES))
def test_every_image_family_gets_the_gradients_it_gets_without(family, tmp_path):
    """Trained whole, in train mode: the same gradients and the same buffers after a step (BatchNorm's running
    statistics among them, where a family checkpoints none of its BatchNorm layers)."""
    from accelerate import Accelerator
    from transformers import AutoModelForImageClassification

    import ddp_utils
    from ddp_utils import UsageError

    Accelerator(cpu=True)
    source = make_family_model(family, tmp_path / family)
    model_class = getattr(transformers, IMAGE_FAMILIES[family][1])
    vision = None

    def trained_once(checkpointing: bool):
        nonlocal vision
        torch.manual_seed(0)
        model = ddp_utils.load_pretrained(AutoModelForImageClassification, str(source))
        ddp_utils.checkpoint_if_asked(model, argparse.Namespace(gradient_checkpointing=checkpointing))
        assert model.is_activation_checkpointing == checkpointing
        vision = getattr(model.config, "vision_config", model.config)  # CLIP's and SigLIP's sizes are there
        size = vision.image_size[0] if isinstance(vision.image_size, list) else vision.image_size
        model.train()
        torch.manual_seed(1)  # the same images, dropout masks and dropped paths
        pixels = torch.randn(2, vision.num_channels, size, size)
        torch.nn.functional.cross_entropy(model(pixel_values=pixels).logits, torch.tensor([0, 1])).backward()
        return gradients(model), dict(model.named_buffers())

    if not model_class.supports_gradient_checkpointing:
        with pytest.raises(UsageError, match=r"cannot recompute its activations in transformers"):
            trained_once(checkpointing=True)
        return
    if family == "mobilevit":  # BatchNorm inside its checkpointed layers
        with pytest.raises(UsageError, match=r"^--gradient_checkpointing: MobileViTForImageClassification's "
                                             r"checkpointed layers hold BatchNorm, whose running statistics the "
                                             r"recomputation would update a second time every step"):  # fmt: skip
            trained_once(checkpointing=True)
        from ddp_utils.training.activation_checkpointing import checkpoint_for_fsdp

        with pytest.raises(UsageError, match=r"^the launch config's fsdp_activation_checkpointing: MobileViT"):
            checkpoint_for_fsdp(AutoModelForImageClassification.from_pretrained(source))  # FSDP's path alike
        return
    (plain, plain_buffers), (checkpointed, buffers) = trained_once(False), trained_once(True)
    assert_same_gradients(plain, checkpointed)
    for name, buffer in plain_buffers.items():
        torch.testing.assert_close(buffers[name], buffer, msg=name)


@pytest.mark.parametrize("family", ["swin", "vit"])
def test_each_layer_is_recomputed_once_where_checkpointed_layers_nest(family, tmp_path):
    """Swin's stages and the layers in them are each a checkpointed layer: both on, the stage's recomputation ran
    each layer's forward again inside its own backward (3 passes a step). The inner layers alone are checkpointed: 2
    passes, as in a ViT."""
    from accelerate import PartialState
    from transformers import AutoModelForImageClassification

    import ddp_utils

    PartialState(cpu=True)
    model = AutoModelForImageClassification.from_pretrained(make_family_model(family, tmp_path / family))
    ddp_utils.checkpoint_if_asked(model, argparse.Namespace(gradient_checkpointing=True))
    first = next(m for name, m in model.named_modules() if name.endswith("q_proj"))  # the first layer's
    calls = []
    first.register_forward_hook(lambda *_: calls.append(1))
    model.train()
    model(pixel_values=torch.randn(2, 3, 32, 32)).logits.sum().backward()
    assert len(calls) == 2


def test_a_hybrid_layer_holding_a_checkpointed_mamba_layer_is_recomputed_whole_once():
    """Zamba2's hybrid layer checkpoints its mamba layer and holds its shared attention beside it: the hybrid layer
    stays checkpointed (its attention recomputed, not kept), the mamba layer inside it not again."""
    from accelerate import PartialState
    from model_families import TEXT_FAMILIES, tiny_model

    import ddp_utils

    PartialState(cpu=True)
    model = tiny_model(*TEXT_FAMILIES["zamba2"])
    ddp_utils.checkpoint_if_asked(model, argparse.Namespace(gradient_checkpointing=True))
    calls = {"attention": [], "mamba": []}
    for name, module in model.named_modules():
        if name.endswith("shared_transformer.self_attn.q_proj") or name.endswith("mamba.in_proj"):
            kind = "attention" if "self_attn" in name else "mamba"
            module.register_forward_hook(lambda *_, kind=kind: calls[kind].append(1))
    model.train()
    ids = torch.arange(8).repeat(2, 1) + 3
    model(input_ids=ids, labels=ids).loss.backward()
    layers = len(model.model.layers)
    hybrid = sum(type(layer).__name__ == "Zamba2HybridLayer" for layer in model.model.layers)
    assert len(calls["attention"]) == 2 * hybrid and len(calls["mamba"]) == 2 * layers, calls


def test_an_unchecked_batchnorm_would_have_counted_each_step_twice(tmp_path):
    """Why MobileViT is refused: checkpointed anyway, its BatchNorm layers count 2 batches a step."""
    from transformers import AutoModelForImageClassification

    model = AutoModelForImageClassification.from_pretrained(make_family_model("mobilevit", tmp_path / "mobilevit"))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    model(pixel_values=torch.randn(2, 3, 32, 32)).logits.sum().backward()
    counts = {int(b) for name, b in model.named_buffers() if name.endswith("num_batches_tracked")}
    assert counts == {1, 2}  # 1 outside the checkpointed layers, 2 inside


def test_train_py_trains_the_same_classifier_with_it_on_two_processes(tiny_data, tmp_path):
    """The whole tiny BERT with dropout 0.1 on 2 processes: the same model with --gradient_checkpointing as without."""
    model = make_tiny_model(tmp_path / "bert", dropout=0.1)
    args = ["--max_train_steps", 3, "--report_to", "none", "--checkpointing_steps", "no"]
    saved = {}
    for checkpointing in (False, True):
        output_dir = tmp_path / f"checkpointing-{checkpointing}"
        run = launch(TRAIN, *train_args(model, tiny_data, output_dir, *args,
                                        *(["--gradient_checkpointing"] if checkpointing else [])))  # fmt: skip
        assert run.returncode == 0, run.output[-3000:]
        assert (CHECKPOINTED in run.output) == checkpointing
        saved[checkpointing] = load_file(str(output_dir / "model.safetensors"))
    assert_same_weights(saved[False], saved[True])


def test_train_image_py_trains_the_same_swin_with_it_on_two_processes(tmp_path):
    """A tiny Swin (stochastic depth 0.1, as Swin's config has it by default) on 2 processes: the same model with
    --gradient_checkpointing as without."""
    images = {
        "train": write_image_folder(tmp_path / "train", {"dark": 6, "bright": 5, "striped": 5}, seed=1),
        "validation": write_image_folder(tmp_path / "validation", {"dark": 2, "bright": 2, "striped": 2}, seed=2),
    }
    source = make_family_model("swin", tmp_path / "swin")
    assert transformers.AutoConfig.from_pretrained(source).drop_path_rate == 0.1
    saved = {}
    for checkpointing in (False, True):
        output_dir = tmp_path / f"checkpointing-{checkpointing}"
        extra = ["--max_train_steps", 2, "--per_device_train_batch_size", 4]
        run = launch(TRAIN_IMAGE, *image_args(source, images, output_dir, *extra,
                                              *(["--gradient_checkpointing"] if checkpointing else [])))  # fmt: skip
        assert run.returncode == 0, run.output[-3000:]
        assert (CHECKPOINTED in run.output) == checkpointing
        saved[checkpointing] = load_file(str(output_dir / "model.safetensors"))
    assert_same_weights(saved[False], saved[True])


def assert_same_weights(plain: dict, checkpointed: dict) -> None:
    assert sorted(plain) == sorted(checkpointed)
    for key, value in plain.items():
        np.testing.assert_allclose(checkpointed[key], value, rtol=1e-5, atol=1e-6, err_msg=key)


def test_every_batchnorm_with_running_statistics_is_found_and_remote_code_keeps_the_embedding_hook():
    """What the refusals test: BatchNorm of any kind (lazy, synchronised) that keeps running statistics, not one that
    normalises by the batch alone. A model with --trust_remote_code keeps the hook that makes the embeddings' output
    require a gradient: its own code may call torch's checkpoint itself, reentrant by default, where without the hook
    its layers' adapters would get none."""
    from accelerate import PartialState
    from model_families import HYBRIDS, tiny_model

    from ddp_utils.training.activation_checkpointing import drop_input_require_grads, tracks_running_statistics

    norms = [torch.nn.LazyBatchNorm2d(), torch.nn.SyncBatchNorm(4), torch.nn.BatchNorm1d(4)]
    norms += [torch.nn.BatchNorm2d(4, track_running_stats=False), torch.nn.LayerNorm(4)]
    found = [tracks_running_statistics(m) for m in norms]
    assert found == [True, True, True, False, False]

    PartialState(cpu=True)
    for remote in (False, True):
        model = tiny_model(*HYBRIDS["qwen3 (attention only)"])
        if remote:  # as transformers names the classes of a Hub repository's own code
            layer = model.model.layers[0]
            layer.__class__ = type(type(layer).__name__, (type(layer),), {"__module__": "transformers_modules.repo"})
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        drop_input_require_grads(model)
        assert len(model.get_input_embeddings()._forward_hooks) == (1 if remote else 0)

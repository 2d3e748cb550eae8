"""Images into model inputs: any mode to the model's (16-bit scans scaled, CIELab converted), the image processor
checked against the model before training, the model run once on its output (the parameters DDP must expect unused),
a light augmentation that depends only on the seed, the epoch and the example, and SyncBatchNorm. Reading and
checking image folders: image_folders.py; other datasets' columns: image_columns.py.

PIL and NumPy only: torchvision has no CPU wheel on many machines and pulls CUDA packages.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.logging import get_logger

from ..core.errors import UsageError
from .dataloaders import EPOCH, SAMPLE_WEIGHT

logger = get_logger(__name__)
EXAMPLE_ID = "example_id"  # each training image's index: with the seed and epoch, it fixes its augmentation


def random_shift(image, rng: np.random.Generator, fraction: float = 0.125, flip: bool = False):
    """Light augmentation: move the image by up to `fraction` of its size in each direction
    (the uncovered border is black) and, with `flip`, mirror it left-right half of the time."""
    from PIL import Image

    width, height = image.size
    dx, dy = (int(rng.integers(-max(1, round(fraction * n)), max(1, round(fraction * n)) + 1)) for n in (width, height))
    image = image.transform(image.size, Image.Transform.AFFINE, (1, 0, dx, 0, 1, dy), resample=Image.Resampling.NEAREST)
    if flip and rng.random() < 0.5:
        image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return image


def in_mode(image, mode: str):
    """`image` in `mode` (RGB or L). An image of 16-bit or 32-bit integers (16-bit PNG and TIFF scans: I;16, I) or of
    floats (F) is first scaled to 8 bits: PIL's own conversion clips it, which turned most 16-bit pixels white. A
    32-bit image (I) whose values all fit in 8 bits is taken as 8-bit: `datasets` stores arrays of int64 or int32
    pixels 0-255 (MNIST read with NumPy or pandas) as I, which the scaling turned black; 16-bit files open as I;16
    (Pillow 13), always scaled, so a dim scan stays as dim as its siblings. CIELab (TIFF) goes through ImageCms."""
    from PIL import Image

    if image.mode.startswith("I;16") or image.mode == "I":  # 16-bit values, also where PIL holds them as I
        pixels = np.asarray(image, dtype=np.float64)
        eight_bit = image.mode == "I" and pixels.size and pixels.max() <= 255
        pixels = pixels if eight_bit else pixels / 257
        image = Image.fromarray(np.clip(np.rint(pixels), 0, 255).astype(np.uint8))
    elif image.mode == "F":  # floats: in [0, 1] as most tools write them, else taken as 0 to 255
        pixels = np.asarray(image, dtype=np.float64)
        pixels = pixels * 255 if pixels.size and np.nanmax(pixels) <= 1 else pixels
        image = Image.fromarray(np.clip(np.rint(np.nan_to_num(pixels)), 0, 255).astype(np.uint8))
    elif image.mode == "LAB":  # PIL converts it to nothing else ("conversion from LAB to RGB not supported")
        from PIL import ImageCms

        lab, srgb = ImageCms.createProfile("LAB"), ImageCms.createProfile("sRGB")
        image = ImageCms.applyTransform(image, ImageCms.buildTransform(lab, srgb, "LAB", "RGB"))
    return image.convert(mode)


def load_image_processor(source: str, config, trust_remote_code: bool = False):
    """The image processor saved with the model at `source` (`config`, its config), before any image is read: a
    UsageError naming the fix where transformers has no image classifier for the model's type (a vision tower saved
    alone, as CLIPVisionModel; DINOv3; a text model) or where no image processor is saved beside it. Both were a
    traceback. Any rank may call it; no communication."""
    from transformers import AutoImageProcessor, AutoModelForImageClassification
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES as CLASSIFIERS

    remote = "AutoModelForImageClassification" in (getattr(config, "auto_map", None) or {})
    if not remote and type(config) not in AutoModelForImageClassification._model_mapping:
        whole = config.model_type.removesuffix("_vision_model")  # clip_vision_model: CLIP's vision tower alone
        fix = (
            f"it is the vision tower of a {whole!r} model saved alone: give the whole {whole!r} checkpoint"
            if whole in CLASSIFIERS
            else "choose a checkpoint of a family that has one (ViT, DeiT, Swin, ConvNeXt, DINOv2, CLIP, SigLIP, ...)"
        )
        raise UsageError(
            f"--model_name_or_path {source!r} is a {config.model_type!r} model, for which transformers has no image "
            f"classifier (AutoModelForImageClassification); {fix}"
        )
    try:
        return AutoImageProcessor.from_pretrained(source, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        saved = os.path.isfile(os.path.join(source, "preprocessor_config.json"))
        if isinstance(error, OSError) and not saved:  # none there: transformers' own message suggests a download
            raise UsageError(
                f"--model_name_or_path {source!r} has no image processor (preprocessor_config.json), which says how to "
                "resize and normalise its images; save its base model's beside it: "
                "AutoImageProcessor.from_pretrained(<base model>).save_pretrained(<this directory>)"
            ) from None
        # A broken preprocessor_config.json (an OSError too); a processor of its own code without trust_remote_code.
        reason = (str(error).strip().splitlines() or [""])[0][:200]
        raise UsageError(
            f"--model_name_or_path {source!r}: its image processor does not load ({type(error).__name__}: {reason}); "
            "mend its preprocessor_config.json, or give --trust_remote_code for a processor of its own code"
        ) from None


def model_channels(config) -> int:
    """The channels `config`'s model takes: its num_channels, or its vision tower's (CLIP, SigLIP keep it there)."""
    for part in (config, getattr(config, "vision_config", None)):
        if getattr(part, "num_channels", None):
            return part.num_channels
    return 3


def check_image_processor(image_processor, num_channels: int) -> bool:
    """Run the model's image processor on four blank images (wide, tall, two squares) in the collator's mode, before
    training: a UsageError naming the fix where it fails on them or makes other channels than the model takes (a
    3-value image_mean for a 1-channel model, do_convert_rgb), instead of a traceback at the first step. Returns
    True where it keeps each image's aspect ratio (a shortest-edge resize without a crop), whose batches of mixed
    shapes cannot stack: the collator then crops each image to its centred square first, as transformers'
    run_image_classification.py does (Resize and CenterCrop to the shortest edge). No communication."""
    from PIL import Image

    if num_channels not in (1, 3):
        raise UsageError(
            f"the model takes {num_channels}-channel images (num_channels in its config.json), and this script feeds "
            "RGB (3) or grey (1) ones: choose a model of 3 or 1 channels, or convert your images in ImageCollator"
        )
    mode, name = ("RGB" if num_channels == 3 else "L"), type(image_processor).__name__
    mean = getattr(image_processor, "image_mean", None) if getattr(image_processor, "do_normalize", False) else None
    if isinstance(mean, (list, tuple)) and len(mean) != num_channels:  # a 1-channel model given ImageNet's mean
        raise UsageError(
            f"the model's image processor ({name}) normalises {len(mean)} channels (image_mean {list(mean)}) and the "
            f"model takes {num_channels} (num_channels in its config.json): give image_mean and image_std one value "
            "per channel in its preprocessor_config.json"
        )
    if num_channels == 1 and getattr(image_processor, "do_convert_rgb", False):  # grey images made RGB again
        raise UsageError(
            f"the model's image processor ({name}) converts every image to RGB (do_convert_rgb) and the model takes "
            "1 channel (num_channels in its config.json): set do_convert_rgb to false in its preprocessor_config.json"
        )
    shapes = []
    for size in ((48, 24), (24, 48), (48, 48), (24, 24)):
        try:
            pixels = image_processor([Image.new(mode, size, 128)], return_tensors="pt")["pixel_values"]
        except Exception as error:  # any of a processor's own checks: ValueError, TypeError, RuntimeError, ...
            reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
            raise UsageError(
                f"the model's image processor ({name}) fails on a {mode} image, the model's {num_channels} channel(s)"
                f" ({reason}); make its preprocessor_config.json match the model"
            ) from None
        shapes.append(tuple(pixels.shape))
    if shapes[0][1] != num_channels:
        raise UsageError(
            f"the model's image processor ({name}) makes {shapes[0][1]}-channel inputs and the model takes "
            f"{num_channels} (num_channels in its config.json): make its preprocessor_config.json match the model"
        )
    if shapes[0] == shapes[1] or shapes[2] != shapes[3]:  # a fixed size; or none (do_resize off): as given
        return False
    logger.warning(
        f"the image processor ({name}) keeps each image's aspect ratio (size {image_processor.to_dict().get('size')},"
        " no crop), so images of other shapes cannot share a batch: each is cropped to its centred square first; "
        "set do_center_crop and crop_size, or a size of height and width, in preprocessor_config.json to choose"
    )
    return True


def centred_square(image):
    """The largest square in the middle of `image`."""
    width, height = image.size
    side = min(width, height)
    left, top = (width - side) // 2, (height - side) // 2
    return image.crop((left, top, left + side, top + side))


class ImageCollator:
    """Rows with an image and a label -> `pixel_values`, `labels` (and `sample_weight` for training).

    Every image is converted to one mode, RGB or L to match the model's channels, whatever mode
    its file has; with `square` (`check_image_processor`), cropped to its centred square. With
    `augment`, each training image is shifted (and with `flip`, mirrored) by a random draw seeded
    by (seed, epoch, example id): the same for any number of processes or loader workers, and
    after a resume. The rows must carry their epoch: build the training
    dataloader with `make_train_dataloader(..., epoch_in_rows=True)`.
    """

    def __init__(
        self,
        image_processor,
        image_column: str,
        label_column: str,
        num_channels: int,
        augment: bool = False,
        flip: bool = False,
        seed: int = 0,
        square: bool = False,
    ):
        self.image_processor, self.image_column, self.label_column = image_processor, image_column, label_column
        self.mode = "RGB" if num_channels == 3 else "L"
        self.augment, self.flip, self.seed, self.square = augment, flip, seed, square

    def __call__(self, rows: list[dict]) -> dict:
        images = [in_mode(row[self.image_column], self.mode) for row in rows]
        if self.square:
            images = [centred_square(image) for image in images]
        if self.augment:
            images = [
                random_shift(image, np.random.default_rng([self.seed, row[EPOCH], row[EXAMPLE_ID]]), flip=self.flip)
                for image, row in zip(images, rows)
            ]
        pixels = self.image_processor(images, return_tensors="pt")["pixel_values"]  # resized, rescaled, normalised
        batch = {"pixel_values": pixels, "labels": torch.tensor([row[self.label_column] for row in rows])}
        if SAMPLE_WEIGHT in rows[0]:
            batch[SAMPLE_WEIGHT] = torch.tensor([row[SAMPLE_WEIGHT] for row in rows], dtype=torch.float32)
        return batch


def parameters_off_the_logits(model, pixel_values: torch.Tensor) -> list[str]:
    """The names of `model`'s trainable parameters that its logits on `pixel_values` do not depend on, found by
    walking the autograd graph of one forward pass in eval mode (no backward, no BatchNorm statistics updated, no
    random draw). A model that fails on them raises a UsageError naming the fix. No communication."""
    was_training = model.training
    model.eval()
    try:
        with torch.enable_grad():
            logits = model(pixel_values=pixel_values).logits
    except Exception as error:  # a size other than the model's image_size, channels, ...: a ValueError, RuntimeError
        reason = (str(error).strip().splitlines() or [""])[0][:200]
        hint = "; if the sizes differ, make preprocessor_config.json's size the image_size in config.json"
        raise UsageError(
            f"the model fails on one blank image as its image processor makes it, {tuple(pixel_values.shape)} pixel "
            f"values: {type(error).__name__}: {reason}{hint if 'size' in reason or 'match' in reason else ''}"
        ) from None
    finally:
        model.train(was_training)
    reached, seen, stack = set(), set(), [logits.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if hasattr(node, "variable"):  # AccumulateGrad: a leaf, a parameter
            reached.add(id(node.variable))
        stack.extend(next_node for next_node, _ in node.next_functions)
    return [name for name, p in model.named_parameters() if p.requires_grad and id(p) not in reached]


def expect_unused_parameters(accelerator: Accelerator, model, image_processor, num_channels: int) -> list[str]:
    """Run `model` once on what `image_processor` makes of a blank image, before `accelerator.prepare`: a model
    that cannot take it is refused in one line (`parameters_off_the_logits`), and where some trainable parameters
    never reach the logits, DDP is told to expect them. Returns their names. Every rank calls it, on the same model
    and image, so every rank makes the same choice; no communication.

    DINOv2's mask token (used in pre-training only), CLIP's post-layernorm and SigLIP's attention-pooling head (they
    make the pooled output, and the classifier reads the mean of the patch tokens) get no gradient: DDP, which
    expects one for every parameter, failed at the second step ("Expected to have finished reduction in the prior
    iteration"). With `find_unused_parameters` it marks them ready itself, each step; one process leaves them as
    they are, and so do N. Nothing is done under FSDP and DeepSpeed, whose model may not be whole here (FSDP2, ZeRO-2
    and ZeRO-3 trained DINOv2 and CLIP as they are)."""
    from accelerate.utils import DistributedDataParallelKwargs
    from PIL import Image

    from ..core.sharded import is_sharded

    if is_sharded(accelerator):
        return []
    mode = "RGB" if num_channels == 3 else "L"
    pixels = image_processor([Image.new(mode, (48, 48), 128)], return_tensors="pt")["pixel_values"]
    unused = parameters_off_the_logits(model, pixels.to(next(model.parameters()).dtype))
    if unused:  # also on 1 process: a MULTI_CPU or MULTI_GPU launch of one process is wrapped in DDP too
        handler = accelerator.ddp_handler or DistributedDataParallelKwargs()
        handler.find_unused_parameters = True
        accelerator.ddp_handler = handler  # read by accelerator.prepare when it wraps the model in DDP
        shown = ", ".join(unused[:5]) + (f" and {len(unused) - 5} more" if len(unused) > 5 else "")
        logger.info(f"{len(unused)} parameter(s) never reach the logits ({shown}): DDP finds them unused each step")
    return unused


def count_batchnorm(model) -> int:
    return sum(isinstance(module, torch.nn.modules.batchnorm._BatchNorm) for module in model.modules())


def check_sync_batchnorm(accelerator: Accelerator) -> None:
    """Refuse --sync_batchnorm where it cannot run, before any data is loaded. Every rank calls it.

    Measured with torch 2.13: SyncBatchNorm refuses CPU tensors in a multi-process run ("expected
    input tensor to be on GPU or XPU"), which would surface inside the first forward pass."""
    if accelerator.device.type not in ("cuda", "xpu"):
        raise UsageError(
            "--sync_batchnorm needs GPUs: torch's SyncBatchNorm refuses CPU tensors. On CPU drop the flag "
            "(each process then normalises over its own per-process batch; see the README)"
        )


def convert_sync_batchnorm(model):
    """Replace every BatchNorm layer of `model` by a SyncBatchNorm that normalises over the whole
    global batch (all processes), keeping its weights and running statistics. Call it on every
    rank before `accelerator.prepare`. A model without BatchNorm (ViT and other LayerNorm models
    normalise per example) is returned unchanged, with a warning."""
    found = count_batchnorm(model)
    if not found:
        logger.warning("--sync_batchnorm: this model has no BatchNorm layer, so there is nothing to synchronise")
        return model
    model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    logger.info(f"--sync_batchnorm: {found} BatchNorm layers now normalise over the global batch")
    return model

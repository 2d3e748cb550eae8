"""Tiny image classifiers of the families users bring, built from a config (no Hub), each saved with the image
processor class its Hub checkpoints have, set as they set it (a crop, a shortest edge, no normalisation, BGR), at a
small size. The models are saved with a 5-class head, so that a run on 3 classes replaces it.
`tests/test_families_images.py` runs each through scripts/train_image.py."""

from __future__ import annotations

import torch

SIZE = 32  # the model's input: height and width
HEAD = 5  # the saved head's classes (a run on 3 replaces it)
IMAGENET = dict(image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225])
HALF = dict(image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
CLIP = dict(image_mean=[0.48145466, 0.4578275, 0.40821073], image_std=[0.26862954, 0.26130258, 0.27577711])
SQUARE = {"height": SIZE, "width": SIZE}
VIT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
ENCODER = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
CROP = dict(size={"shortest_edge": SIZE + 4}, do_center_crop=True, crop_size=SQUARE)  # as shortest_edge 256, crop 224


def _without(settings: dict, *names) -> dict:
    return {key: value for key, value in settings.items() if key not in names}


# family: (config class, model class, config settings, processor class, processor settings, has BatchNorm)
IMAGE_FAMILIES = {
    "vit": ("ViTConfig", "ViTForImageClassification", dict(image_size=SIZE, patch_size=8, **VIT),
            "ViTImageProcessor", dict(size=SQUARE, **HALF), False),
    "deit": ("DeiTConfig", "DeiTForImageClassification", dict(image_size=SIZE, patch_size=8, **VIT),
             "DeiTImageProcessor", dict(size={"height": SIZE + 4, "width": SIZE + 4}, crop_size=SQUARE, **IMAGENET),
             False),
    # the distilled checkpoints: two heads (class token, distillation token) whose logits are averaged
    "deit_distilled": ("DeiTConfig", "DeiTForImageClassificationWithTeacher",
                       dict(image_size=SIZE, patch_size=8, **VIT),
                       "DeiTImageProcessor", dict(size={"height": SIZE + 4, "width": SIZE + 4}, crop_size=SQUARE,
                                                  **IMAGENET), False),
    "beit": ("BeitConfig", "BeitForImageClassification",
             dict(image_size=SIZE, patch_size=8, use_relative_position_bias=True, **VIT),
             "BeitImageProcessor", dict(size=SQUARE, do_center_crop=False, **HALF), False),
    "data2vec_vision": ("Data2VecVisionConfig", "Data2VecVisionForImageClassification",
                        dict(image_size=SIZE, patch_size=8, use_relative_position_bias=True, **VIT),
                        "BeitImageProcessor", dict(size=SQUARE, do_center_crop=False, **HALF), False),
    "swin": ("SwinConfig", "SwinForImageClassification",
             dict(image_size=SIZE, patch_size=2, embed_dim=16, depths=[1, 1], num_heads=[1, 2], window_size=4),
             "ViTImageProcessor", dict(size=SQUARE, **IMAGENET), False),
    "swinv2": ("Swinv2Config", "Swinv2ForImageClassification", dict(image_size=SIZE, patch_size=2, embed_dim=16,
                                                                    depths=[1, 1], num_heads=[1, 2], window_size=4),
               "ViTImageProcessor", dict(size=SQUARE, **IMAGENET), False),
    "convnext": ("ConvNextConfig", "ConvNextForImageClassification", dict(num_stages=2, hidden_sizes=[16, 32],
                                                                          depths=[1, 1]),
                 "ConvNextImageProcessor", dict(size={"shortest_edge": SIZE}, crop_pct=0.875, **IMAGENET), False),
    "convnextv2": ("ConvNextV2Config", "ConvNextV2ForImageClassification", dict(num_stages=2, hidden_sizes=[16, 32],
                                                                                depths=[1, 1]),
                   "ConvNextImageProcessor", dict(size={"shortest_edge": SIZE}, crop_pct=0.875, **IMAGENET), False),
    "dinov2": ("Dinov2Config", "Dinov2ForImageClassification", dict(image_size=SIZE, patch_size=8, mlp_ratio=2,
                                                                    **_without(VIT, "intermediate_size")),
               "BitImageProcessor", dict(**CROP, **IMAGENET), False),
    "dinov2_registers": ("Dinov2WithRegistersConfig", "Dinov2WithRegistersForImageClassification",
                         dict(image_size=SIZE, patch_size=8, mlp_ratio=2, num_register_tokens=2,
                              **_without(VIT, "intermediate_size")),
                         "BitImageProcessor", dict(**CROP, **IMAGENET), False),
    "hiera": ("HieraConfig", "HieraForImageClassification", dict(image_size=[SIZE, SIZE], embed_dim=8, depths=[1, 1],
                                                                 num_heads=[1, 2], num_query_pool=1,
                                                                 masked_unit_size=[4, 4],
                                                                 masked_unit_attention=[True, False]),
              "BitImageProcessor", dict(**CROP, **IMAGENET), False),
    "pvt": ("PvtConfig", "PvtForImageClassification", dict(image_size=SIZE, num_encoder_blocks=2, depths=[1, 1],
                                                           sequence_reduction_ratios=[2, 1], hidden_sizes=[16, 32],
                                                           patch_sizes=[4, 2], strides=[4, 2],
                                                           num_attention_heads=[1, 2], mlp_ratios=[2, 2]),
            "PvtImageProcessor", dict(size=SQUARE, **IMAGENET), False),
    "pvt_v2": ("PvtV2Config", "PvtV2ForImageClassification", dict(image_size=SIZE, num_encoder_blocks=2, depths=[1, 1],
                                                                 sr_ratios=[2, 1], hidden_sizes=[16, 32],
                                                                 patch_sizes=[7, 3], strides=[4, 2],
                                                                 num_attention_heads=[1, 2], mlp_ratios=[2, 2]),
               "PvtImageProcessor", dict(size=SQUARE, **IMAGENET), False),
    "poolformer": ("PoolFormerConfig", "PoolFormerForImageClassification", dict(
        num_encoder_blocks=2, depths=[1, 1], hidden_sizes=[16, 32], patch_sizes=[7, 3], strides=[4, 2], padding=[2, 1],
        mlp_ratio=2.0), "PoolFormerImageProcessor", dict(size={"shortest_edge": SIZE}, crop_pct=0.9, crop_size=SQUARE,
                                                         **IMAGENET), False),
    "bit": ("BitConfig", "BitForImageClassification", dict(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                                                           num_groups=2, global_padding="SAME",
                                                           embedding_dynamic_padding=True),
            "BitImageProcessor", dict(**CROP, **HALF), False),
    "siglip": ("SiglipConfig", "SiglipForImageClassification", dict(
        vision_config=dict(image_size=SIZE, patch_size=8, **ENCODER), text_config=dict(vocab_size=64, **ENCODER)),
        "SiglipImageProcessor", dict(size=SQUARE, **HALF), False),
    "clip": ("CLIPConfig", "CLIPForImageClassification", dict(
        vision_config=dict(image_size=SIZE, patch_size=8, **ENCODER), text_config=dict(vocab_size=64, **ENCODER)),
        "CLIPImageProcessor", dict(size={"shortest_edge": SIZE}, crop_size=SQUARE, **CLIP), False),
    "grayscale_vit": ("ViTConfig", "ViTForImageClassification", dict(image_size=SIZE, patch_size=8, num_channels=1,
                                                                     **VIT),
                      "ViTImageProcessor", dict(size=SQUARE, image_mean=[0.5], image_std=[0.5]), False),
    # BatchNorm inside: 2 processes normalise over their own images (docs/images.md)
    "efficientnet": ("EfficientNetConfig", "EfficientNetForImageClassification", dict(
        image_size=SIZE, width_coefficient=0.25, depth_coefficient=0.5, kernel_sizes=[3, 5], in_channels=[32, 16],
        out_channels=[16, 24], strides=[1, 2], num_block_repeats=[1, 2], expand_ratios=[1, 6], hidden_dim=320),
        "EfficientNetImageProcessor", dict(size=SQUARE, image_mean=IMAGENET["image_mean"],
                                           image_std=[0.47853944, 0.4732864, 0.47434163]), True),
    "mobilenet_v2": ("MobileNetV2Config", "MobileNetV2ForImageClassification", dict(
        image_size=SIZE, depth_multiplier=0.25, min_depth=4), "MobileNetV2ImageProcessor", dict(**CROP, **HALF), True),
    "mobilevit": ("MobileViTConfig", "MobileViTForImageClassification", dict(
        image_size=SIZE, hidden_sizes=[16, 16, 16], neck_hidden_sizes=[8, 8, 16, 16, 16, 16, 32], num_attention_heads=2,
        expand_ratio=2.0), "MobileViTImageProcessor", dict(**CROP, do_flip_channel_order=True), True),
    "regnet": ("RegNetConfig", "RegNetForImageClassification", dict(embedding_size=8, hidden_sizes=[8, 16],
                                                                    depths=[1, 1], groups_width=8),
               "ConvNextImageProcessor", dict(size={"shortest_edge": SIZE}, crop_pct=0.875, **IMAGENET), True),
    "levit": ("LevitConfig", "LevitForImageClassificationWithTeacher", dict(
        image_size=SIZE * 2, hidden_sizes=[16, 32, 48], num_attention_heads=[1, 2, 3], depths=[1, 1, 1],
        key_dim=[8, 8, 8], mlp_ratio=[2, 2, 2], attention_ratio=[2, 2, 2]),  # 3 stages: its config makes 2 subsamplings
        "LevitImageProcessor", dict(size={"shortest_edge": SIZE * 2}, crop_size={"height": SIZE * 2, "width": SIZE * 2},
                                    **IMAGENET), True),
}  # fmt: skip


def make_family_model(family: str, directory, num_labels: int = HEAD):
    """`family`'s tiny model with a `num_labels` head and its image processor, saved in `directory`."""
    import transformers

    config_class, model_class, settings, processor_class, processor_settings, _ = IMAGE_FAMILIES[family]
    labels = {f"class_{i}": i for i in range(num_labels)}
    config = getattr(transformers, config_class)(
        **settings, num_labels=num_labels, label2id=labels, id2label={i: name for name, i in labels.items()}
    )
    torch.manual_seed(0)
    getattr(transformers, model_class)(config).save_pretrained(directory)
    getattr(transformers, processor_class)(**processor_settings).save_pretrained(directory)
    return directory


def has_batchnorm(family: str) -> bool:
    return IMAGE_FAMILIES[family][5]

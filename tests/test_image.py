"""scripts/train_image.py on 2 processes: a model without BatchNorm trains the same on
2 processes x B as on 1 x 2B (augmentation included); one with BatchNorm does not, and the test
shows by how much; --sync_batchnorm; evaluation counts each image once; the saved model reloads
through `pipeline`; unreadable images; the offline default."""

import json
import os
import random
import re
import shutil

import numpy as np
import pytest
import torch
from image_families import ENCODER, make_family_model
from PIL import Image
from safetensors.numpy import load_file

from conftest import AUDIT_HOOK_DIR, REPO, assert_fails_cleanly, launch

TRAIN_IMAGE = REPO / "scripts" / "train_image.py"
CLASSES = ("dark", "bright", "striped")


def class_image(kind: str, rng: random.Random) -> Image.Image:
    """A 10-14 px image whose class shows in its pixels, saved in a mode that varies by image."""
    size = rng.randint(10, 14)
    noise = np.array([[rng.randint(0, 40) for _ in range(size)] for _ in range(size)])
    pixels = {
        "dark": noise,
        "bright": 215 + noise,
        "striped": np.where(np.arange(size)[None, :] % 4 < 2, 230, 20) + noise // 2,
    }.get(kind, 120 + noise)
    image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), mode="L")
    return {0: image, 1: image.convert("RGB"), 2: image.convert("RGBA"), 3: image.convert("P")}[rng.randint(0, 3)]


def write_image_folder(root, counts: dict, seed: int):
    """root/<class>/<i>.png for each class and count, in mixed modes (L, RGB, RGBA, P)."""
    rng = random.Random(seed)
    for kind, count in counts.items():
        (root / kind).mkdir(parents=True, exist_ok=True)
        for i in range(count):
            class_image(kind, rng).save(root / kind / f"{i}.png")
    return root


def make_tiny_vit(directory):
    """A 2-layer ViT (LayerNorm, no BatchNorm) for 16x16 RGB images, with its image processor."""
    from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessor

    torch.manual_seed(0)
    config = ViTConfig(
        image_size=16,
        patch_size=4,
        num_channels=3,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    ViTForImageClassification(config).save_pretrained(directory)
    ViTImageProcessor(size={"height": 16, "width": 16}, image_mean=[0.5] * 3, image_std=[0.5] * 3).save_pretrained(
        directory
    )
    return directory


def make_tiny_resnet(directory):
    """A 2-stage ResNet (BatchNorm after every convolution) for 16x16 RGB images, with its image processor."""
    from transformers import ResNetConfig, ResNetForImageClassification, ViTImageProcessor

    torch.manual_seed(0)
    config = ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic")
    ResNetForImageClassification(config).save_pretrained(directory)
    ViTImageProcessor(size={"height": 16, "width": 16}, image_mean=[0.5] * 3, image_std=[0.5] * 3).save_pretrained(
        directory
    )
    return directory


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    base = tmp_path_factory.mktemp("images")
    return {
        "train": write_image_folder(base / "train", {"dark": 14, "bright": 13, "striped": 13}, seed=1),  # 40 images
        "validation": write_image_folder(base / "validation", {"dark": 5, "bright": 4, "striped": 4}, seed=2),
    }  # 13: a prime


def image_args(model, images, output_dir, *extra):
    return [
        "--model_name_or_path",
        model,
        "--train_dir",
        images["train"],
        "--validation_dir",
        images["validation"],
        "--output_dir",
        output_dir,
        "--learning_rate",
        3e-3,
        "--warmup_ratio",
        0.0,
        "--num_train_epochs",
        3,
        "--per_device_eval_batch_size",
        4,
        "--checkpointing_steps",
        "no",
        "--report_to",
        "none",
        *extra,
    ]


# The same training two ways: 1 process x batch 8, and 2 processes x batch 4 whose batches are made
# by 2 persistent loader workers each (they must still shift each image by its own epoch's draw).
LAYOUTS = {
    "one_process": (1, ["--per_device_train_batch_size", 8]),
    "two_processes": (2, ["--per_device_train_batch_size", 4, "--num_workers", 2]),
}


@pytest.fixture(scope="module")
def runs(images, tmp_path_factory):
    base = tmp_path_factory.mktemp("image-runs")
    models = {"vit": make_tiny_vit(base / "vit"), "resnet": make_tiny_resnet(base / "resnet")}
    results = {}
    for model_name, model in models.items():
        for layout, (num_processes, extra) in LAYOUTS.items():
            output_dir = base / f"{model_name}-{layout}"
            result = launch(TRAIN_IMAGE, *image_args(model, images, output_dir, *extra), num_processes=num_processes)
            assert result.returncode == 0, result.output[-4000:]
            results[model_name, layout] = output_dir
    return {"runs": results, "models": models}


def weights(output_dir):
    return load_file(str(output_dir / "model.safetensors"))


def test_without_batchnorm_two_processes_train_the_same_model_as_one(runs):
    """Augmentation included: each image's random shift depends on (seed, epoch, image) only, also
    when persistent loader workers (--num_workers 2) make the batches of all 3 epochs."""
    reference, other = weights(runs["runs"]["vit", "one_process"]), weights(runs["runs"]["vit", "two_processes"])
    initial = weights(runs["models"]["vit"])
    same_shape = [k for k in initial if k in reference and initial[k].shape == reference[k].shape]
    assert sum(not np.allclose(initial[k], reference[k]) for k in same_shape) > len(same_shape) // 2, (
        "training barely changed the model"
    )
    for key in reference:
        if key.endswith("attention.key.bias"):
            # Its exact gradient is zero (a constant added to every key score leaves the softmax
            # unchanged), so Adam turns rounding noise into steps: only check it stays noise.
            assert np.abs(other[key]).max() < 1e-3 and np.abs(reference[key]).max() < 1e-3, key
            continue
        np.testing.assert_allclose(other[key], reference[key], rtol=1e-4, atol=1e-5, err_msg=key)


def test_with_batchnorm_each_process_normalises_its_own_batch(runs):
    """Without SyncBatchNorm, each process normalises over its own 4 images, not the global 8, and
    DDP copies rank 0's running statistics to the others: the model differs from the 1-process
    one. The running means and variances move by far more than rounding (which stays below 1e-5
    in the ViT comparison above), and so do the weights they feed. This is the difference
    --sync_batchnorm removes on GPUs."""
    reference, other = weights(runs["runs"]["resnet", "one_process"]), weights(runs["runs"]["resnet", "two_processes"])
    statistics = [k for k in reference if k.endswith(("running_mean", "running_var"))]
    assert len(statistics) >= 10, "every BatchNorm layer has running statistics"
    gaps = {k: float(np.abs(other[k] - reference[k]).max() / (np.abs(reference[k]).max() + 1e-8)) for k in statistics}
    assert min(gaps.values()) > 1e-3, (
        f"every layer's running statistics differ: {sorted(gaps.items(), key=lambda kv: kv[1])[:3]}"
    )
    convolution = [k for k in reference if k.endswith("convolution.weight")]
    assert any(not np.allclose(other[k], reference[k], rtol=1e-4, atol=1e-5) for k in convolution), (
        "and so do the weights"
    )


def test_a_run_preempted_mid_epoch_resumes_to_the_same_model(runs, images, tmp_path):
    """Augmented images included: after the resume, each image gets the shift it would have got."""
    output_dir = tmp_path / "run"
    args = image_args(
        runs["models"]["vit"], images, output_dir, *LAYOUTS["two_processes"][1], "--checkpointing_steps", 3
    )
    hooks = {"PYTHONPATH": os.pathsep.join([str(AUDIT_HOOK_DIR), str(REPO)])}
    # SIGTERM while the checkpoint of step 6 is written: the ranks save after step 7 (epoch 1, its 2nd step) and exit.
    stopped = launch(TRAIN_IMAGE, *args, num_processes=2, env={**hooks, "SIGTERM_ON_WRITE": ".tmp-checkpoint-6/"})
    assert stopped.returncode != 0 and "checkpoint-7" in os.listdir(output_dir), stopped.output[-3000:]
    resumed = launch(TRAIN_IMAGE, *args, "--resume_from_checkpoint", "latest", num_processes=2)
    assert resumed.returncode == 0, resumed.output[-4000:]
    reference = weights(runs["runs"]["vit", "two_processes"])
    ours = weights(output_dir)
    assert [k for k in reference if not np.array_equal(ours[k], reference[k])] == [], (
        "not bit for bit the uninterrupted run"
    )


def test_evaluation_counts_each_image_once(runs):
    for model_name in ("vit", "resnet"):
        scores = {
            layout: json.loads((runs["runs"][model_name, layout] / "metrics.json").read_text()) for layout in LAYOUTS
        }
        assert scores["one_process"]["eval_examples"] == scores["two_processes"]["eval_examples"] == 13
        confusion = json.loads(
            (runs["runs"][model_name, "two_processes"] / "report" / "confusion_matrix.json").read_text()
        )
        assert np.sum(confusion["counts"]) == 13, "13 is prime: a duplicated padding image would show up here"
        assert confusion["labels"] == sorted(CLASSES)
    vit = {layout: json.loads((runs["runs"]["vit", layout] / "metrics.json").read_text()) for layout in LAYOUTS}
    assert vit["two_processes"]["eval_accuracy"] == vit["one_process"]["eval_accuracy"] > 0.5, (
        "the ViT learned the classes"
    )


def test_saved_model_reloads_through_pipeline_with_the_same_predictions(runs, images):
    from transformers import AutoImageProcessor, AutoModelForImageClassification, pipeline

    output_dir = runs["runs"]["resnet", "two_processes"]
    assert not any(k.startswith("module.") for k in weights(output_dir))
    model = AutoModelForImageClassification.from_pretrained(output_dir).eval()
    processor = AutoImageProcessor.from_pretrained(output_dir)
    assert sorted(model.config.id2label.values()) == sorted(CLASSES)
    classifier = pipeline("image-classification", model=str(output_dir), device=-1)
    pictures = [Image.open(path).convert("RGB") for path in sorted(images["validation"].rglob("*.png"))]
    with torch.no_grad():
        logits = model(**processor(pictures, return_tensors="pt")).logits
    for picture, row in zip(pictures, logits):
        scores = {item["label"]: item["score"] for item in classifier(picture, top_k=None, function_to_apply="none")}
        np.testing.assert_allclose(
            [scores[model.config.id2label[i]] for i in range(len(row))], row.numpy(), rtol=1e-5, atol=1e-5
        )


def test_sync_batchnorm_is_refused_on_cpu_and_converts_every_batchnorm(runs, images, tmp_path):
    output_dir = tmp_path / "out"
    result = launch(
        TRAIN_IMAGE,
        *image_args(runs["models"]["resnet"], images, output_dir, "--sync_batchnorm"),
        num_processes=2,
        timeout=120,
        real_launcher=True,
    )
    assert_fails_cleanly(result, "--sync_batchnorm needs GPUs: torch's SyncBatchNorm refuses CPU tensors", output_dir)

    from accelerate import PartialState
    from transformers import AutoModelForImageClassification

    from ddp_utils.data.vision import convert_sync_batchnorm

    PartialState(cpu=True)  # ddp_utils logs through Accelerate
    model = AutoModelForImageClassification.from_pretrained(runs["models"]["resnet"])
    before = {name: module for name, module in model.named_modules() if isinstance(module, torch.nn.BatchNorm2d)}
    converted = convert_sync_batchnorm(model)
    after = dict(converted.named_modules())
    assert len(before) >= 5
    assert not any(
        isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and not isinstance(m, torch.nn.SyncBatchNorm)
        for m in after.values()
    )
    for name, old in before.items():
        assert isinstance(after[name], torch.nn.SyncBatchNorm), name
        torch.testing.assert_close(after[name].running_var, old.running_var)


def test_an_unreadable_image_is_named_or_skipped_and_counted(runs, images, tmp_path):
    train = tmp_path / "train"
    write_image_folder(train, {"dark": 6, "bright": 6, "striped": 6}, seed=3)
    (train / "bright" / "notes.png").write_bytes(b"this is not a PNG")
    whole = (train / "dark" / "0.png").read_bytes()
    (train / "dark" / "cut.png").write_bytes(whole[: len(whole) // 2])  # a truncated download
    data = {"train": train, "validation": images["validation"]}
    args = image_args(runs["models"]["vit"], data, tmp_path / "refused")
    failed = launch(TRAIN_IMAGE, *args, num_processes=2, timeout=120, real_launcher=True)
    assert_fails_cleanly(failed, "2 train image(s) cannot be read: ", tmp_path / "refused")
    assert "cut.png" in failed.output and "notes.png" in failed.output and "--skip_bad_images" in failed.output

    output_dir = tmp_path / "skipped"
    result = launch(
        TRAIN_IMAGE,
        *image_args(runs["models"]["vit"], data, output_dir, "--skip_bad_images", "--num_train_epochs", 1),
        num_processes=2,
    )
    assert result.returncode == 0, result.output[-4000:]
    metrics = json.loads((output_dir / "metrics.json").read_text())
    assert (metrics["train_images_skipped"], metrics["validation_images_skipped"], metrics["train_samples_seen"]) == (
        2,
        0,
        18,
    )
    assert "| train images skipped | 2 |" in (output_dir / "report" / "README.md").read_text()


def one_class_folder(tmp_path, images):
    return ["--train_dir", write_image_folder(tmp_path / "one", {"dark": 6}, seed=4)]


def images_outside_class_folders(tmp_path, images):
    return ["--train_dir", write_image_folder(tmp_path / "one", {"dark": 6}, seed=4) / "dark"]


def unseen_validation_class(tmp_path, images):
    validation = write_image_folder(tmp_path / "val", {"dark": 2, "bright": 2, "blurred": 2}, seed=5)
    return ["--validation_dir", validation]


BAD_INPUT = {
    "one_class": (one_class_folder, "holds images of one class only ('dark')"),
    "no_class_folders": (images_outside_class_folders, "holds 6 image(s) outside class subfolders (first: '0.png')"),
    "missing_folder": (lambda tmp_path, images: ["--validation_dir", tmp_path / "nope"], "/nope' does not exist"),
    "unseen_validation_class": (
        unseen_validation_class,
        "validation labels ['blurred'] never occur in the training data",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUT))
def test_bad_input_fails_fast_on_every_rank(case, runs, images, tmp_path):
    change, expected = BAD_INPUT[case]
    output_dir = tmp_path / "out"
    args = image_args(runs["models"]["vit"], images, output_dir)
    for flag, value in zip(*[iter(change(tmp_path, images))] * 2):
        args[args.index(flag) + 1] = value
    result = launch(TRAIN_IMAGE, *args, num_processes=2, timeout=120, real_launcher=True)
    assert_fails_cleanly(result, expected, output_dir)


@pytest.mark.fast
def test_an_image_folder_labels_each_image_by_its_class_subfolder_at_any_depth(tmp_path, caplog):
    """Layouts users bring: images nested below their class folder (cat/closeup/, dog/batch1/), the validation
    folder at another depth and given with a trailing slash, macOS's decomposed names and its hidden files, a
    README, a format this Pillow cannot read (HEIC without its plugin: left out, counted in a warning)."""
    from accelerate import PartialState

    from ddp_utils.data.image_folders import image_folders

    PartialState(cpu=True)  # the warning is logged through Accelerate
    train, validation = tmp_path / "train", tmp_path / "deeper" / "by-hand" / "val"
    write_image_folder(train / "cat" / "closeup", {"x": 2}, seed=1)  # train/cat/closeup/x/*.png
    write_image_folder(train / "dog", {"batch1": 2, "batch2": 1}, seed=2)
    write_image_folder(train, {"cafe\u0301": 2}, seed=3)  # "café", decomposed as macOS writes it
    write_image_folder(validation, {"dog": 1, "caf\u00e9": 1}, seed=4)
    (train / "dog" / "batch1" / "again").symlink_to(train / "dog")  # a link to a folder above: walked once
    junks = (".DS_Store", "README.md", "metadata.json", "cat/._0.png", ".ipynb_checkpoints/cat/0.png", "dog/scan.heic")
    for junk in junks:
        (train / junk).parent.mkdir(parents=True, exist_ok=True)
        (train / junk).write_bytes(b"not an image")

    with caplog.at_level("WARNING"):
        raw = image_folders(str(train), f"{validation}/")
    labels = {split: sorted(raw[split]["label"]) for split in raw}
    assert labels == {"train": ["café", "café", "cat", "cat", "dog", "dog", "dog"], "validation": ["café", "dog"]}
    assert "--train_dir: 1 file(s) left out, not images this Pillow reads: .heic (1)" in caplog.text  # not README
    assert raw["train"][0]["image"].size[0] >= 10  # decoded from its path
    assert "hold subfolders named" not in caplog.text


@pytest.mark.fast
def test_the_folders_a_nas_or_a_drive_adds_are_not_classes_nor_images(tmp_path):
    """A folder copied from a Synology NAS holds @eaDir/<image>/SYNOFILE_THUMB_*.jpg beside every image (and in the
    top folder: a class of thumbnails), a drive its recycle bin and lost+found: each was read as a class or as more
    images of one."""
    from ddp_utils.data.image_folders import image_folders

    train = write_image_folder(tmp_path / "train", {"cat": 2, "dog": 2}, seed=0)
    for folder in ("@eaDir/0.png", "cat/@eaDir/0.png", "#recycle/cat", "$RECYCLE.BIN", "lost+found"):
        write_image_folder(train / folder, {"SYNOFILE_THUMB": 1}, seed=1)
    assert sorted(image_folders(str(train))["train"]["label"]) == ["cat", "cat", "dog", "dog"]


@pytest.mark.fast
def test_classes_one_level_too_high_are_warned_of_and_a_double_underscore_class_is_kept(tmp_path, caplog):
    """--train_dir data, holding data/train/cat and data/val/cat: the classes would be "train" and "val".
    datasets' imagefolder named the deepest folders; this reads the first level, and says so where the class
    folders all hold subfolders of the same names."""
    from accelerate import PartialState

    from ddp_utils.data.image_folders import image_folders

    PartialState(cpu=True)
    for split in ("train", "val"):
        write_image_folder(tmp_path / "data" / split, {"cat": 1, "dog": 1, "__background__": 1}, seed=0)
    with caplog.at_level("WARNING"):
        raw = image_folders(str(tmp_path / "data"))
    assert sorted(set(raw["train"]["label"])) == ["train", "val"]
    assert "the class folders ['train', 'val'] all hold subfolders named ['__background__', 'cat', 'dog']" in (
        caplog.text
    )
    assert sorted(set(image_folders(str(tmp_path / "data" / "train"))["train"]["label"])) == [
        "__background__", "cat", "dog"
    ]  # fmt: skip
    caplog.clear()
    tiny_imagenet = tmp_path / "tiny-imagenet" / "train"  # n01443537/images/*.JPEG: one shared name, a layout
    for wnid in ("n01443537", "n01629819"):
        write_image_folder(tiny_imagenet / wnid, {"images": 2}, seed=1)
    (tiny_imagenet / "metadata.csv").write_text("file_name,label\n")
    with caplog.at_level("WARNING"):
        assert sorted(set(image_folders(str(tiny_imagenet))["train"]["label"])) == ["n01443537", "n01629819"]
    assert "hold subfolders named" not in caplog.text and "metadata.csv is not read" in caplog.text


@pytest.mark.fast
@pytest.mark.parametrize(
    "layout, expected",
    [
        (
            {"cat.png": 1, "dog/0.png": 1, "cat/0.png": 1},
            "holds 1 image(s) outside class subfolders (first: 'cat.png')",
        ),
        (
            {"cat/notes.txt": 1, "dog/x.heic": 2},
            "holds no images in class subfolders (cat/1.jpg, cat/2.jpg, dog/1.jpg, ...); left out, not a",
        ),
        ({"cat/0.png": 1, "cat/1.png": 1}, "holds images of one class only ('cat')"),
        ({}, "holds no images in class subfolders"),
        ({"0.png": 1, "1.png": 1, "metadata.csv": 1}, "holds metadata.csv, which this script does not read"),
        ({"cat/0.png": 1, "dog/scan.pdf": 1}, "holds images of one class only ('cat')"),  # Pillow writes PDF only
    ],
    ids=["loose-image", "no-readable-image", "one-class", "empty", "metadata-file", "pdf-is-not-an-image"],
)
def test_an_image_folder_that_cannot_train_is_refused_in_one_line(tmp_path, layout, expected):
    from accelerate import PartialState

    from ddp_utils.core.errors import UsageError
    from ddp_utils.data.image_folders import image_folders

    PartialState(cpu=True)  # ddp_utils logs through Accelerate's logger (a file left out is warned of first)
    train = tmp_path / "train"
    train.mkdir()
    for path in layout:
        (train / path).parent.mkdir(parents=True, exist_ok=True)
        image = path.endswith(".png")
        class_image("dark", random.Random(0)).save(train / path) if image else (train / path).write_bytes(b"x")
    with pytest.raises(UsageError, match=re.escape(expected)):
        image_folders(str(train))


@pytest.mark.fast
def test_an_image_folders_order_mixes_its_classes_and_keeps_when_images_are_added(tmp_path):
    """--max_train_samples takes the first N images: in the folder's sorted order that was one class (a model of
    that class alone, or "validation labels never occur in training"); the order by path hash mixes them."""
    from ddp_utils.data.image_folders import image_folders

    train = write_image_folder(tmp_path / "train", {"dark": 20, "bright": 20, "striped": 20}, seed=0)
    first = image_folders(str(train))["train"]["label"]
    assert len(set(first[:6])) == 3
    write_image_folder(tmp_path / "train", {"new": 5}, seed=1)
    again = image_folders(str(train))["train"]["label"]
    assert [label for label in again if label != "new"] == first


@pytest.mark.fast
def test_16_bit_and_float_images_are_scaled_to_8_bits_not_clipped_white(tmp_path):
    """A 16-bit PNG opens as I;16 (values up to 65,535): PIL's own conversion to RGB clipped nearly every pixel to
    white, and a run on such scans ended at chance accuracy, reported as a success."""
    from ddp_utils.data.vision import in_mode

    values = np.linspace(0, 65535, 64, dtype=np.uint16).reshape(8, 8)
    Image.fromarray(values).save(tmp_path / "scan.png")
    scan = Image.open(tmp_path / "scan.png")
    assert scan.mode.startswith("I")
    expected = np.rint(values / 257).astype(np.uint8)
    np.testing.assert_array_equal(np.asarray(in_mode(scan, "L")), expected)
    np.testing.assert_array_equal(np.asarray(in_mode(scan, "RGB"))[..., 1], expected)
    floats = Image.fromarray((values / 65535).astype(np.float32))
    np.testing.assert_array_equal(np.asarray(in_mode(floats, "L")), np.rint(values / 65535 * 255).astype(np.uint8))
    rgba = class_image("striped", random.Random(1)).convert("RGBA")
    np.testing.assert_array_equal(np.asarray(in_mode(rgba, "RGB")), np.asarray(rgba.convert("RGB")))


@pytest.mark.fast
def test_the_image_check_runs_once_for_all_ranks_and_again_when_a_file_changes(tmp_path, monkeypatch):
    """Every rank prepares the data after the main process, and each decoded every image again to find the
    unreadable ones: on an ImageNet folder, about 100 minutes per rank. The answer is kept in the datasets cache,
    keyed by the files' sizes and times; the decoding runs on several processes where the work is worth it."""
    import datasets

    from ddp_utils.data import image_folders as folders

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    train = write_image_folder(tmp_path / "train", {"dark": 6, "bright": 6}, seed=0)
    (train / "dark" / "notes.png").write_bytes(b"this is not a PNG")
    raw = folders.image_folders(str(train))["train"]
    row = list(raw.with_format("arrow")["image"].combine_chunks().field("path").to_pylist()).index(
        str(train / "dark" / "notes.png")
    )
    monkeypatch.setattr(folders, "IMAGES_PER_PROCESS", 4)  # 13 images: 2 processes here
    assert folders.find_bad_images(raw, "image") == [(row, "dark/notes.png (UnidentifiedImageError)")]

    def decoded(value):
        raise AssertionError("decoded again")

    with monkeypatch.context() as patch:  # another rank: the answer read, nothing decoded
        patch.setattr(folders, "_image_problem", decoded)
        assert folders.find_bad_images(raw, "image") == [(row, "dark/notes.png (UnidentifiedImageError)")]
    class_image("dark", random.Random(0)).save(train / "dark" / "notes.png")  # fixed: checked again, readable
    assert folders.find_bad_images(raw, "image") == []


def killed(value):
    os._exit(9)  # as the kernel's OOM killer ends a process


@pytest.mark.fast
def test_a_killed_image_checking_process_ends_the_check_in_one_line_not_a_hang(tmp_path, monkeypatch):
    import datasets

    from ddp_utils.data import image_folders as folders

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    raw = folders.image_folders(str(write_image_folder(tmp_path / "train", {"dark": 6, "bright": 6}, seed=0)))
    monkeypatch.setattr(folders, "IMAGES_PER_PROCESS", 4)
    monkeypatch.setattr(folders, "_image_problem", killed)
    with pytest.raises(RuntimeError, match="a process checking the images died \\(out of memory\\?\\)"):
        folders.find_bad_images(raw["train"], "image")


def test_offline_default_runs_a_few_steps(tmp_path):
    output_dir = tmp_path / "out"
    args = ["--output_dir", output_dir, "--max_train_steps", 3, "--max_eval_samples", 50]
    result = launch(TRAIN_IMAGE, *args, num_processes=2, real_launcher=True)  # as users run it: `accelerate launch`
    assert result.returncode == 0, result.output[-4000:]
    metrics = json.loads((output_dir / "metrics.json").read_text())
    assert (metrics["optimizer_steps"], metrics["eval_examples"], metrics["train_samples_seen"]) == (3, 50, 3 * 64)
    config = json.loads((output_dir / "config.json").read_text())
    assert config["model_type"] == "resnet" and config["id2label"]["7"] == "7"
    from huggingface_hub import ModelCard

    card = ModelCard.load(output_dir / "README.md")
    assert card.data.pipeline_tag == "image-classification" and card.data.base_model is None
    assert "A model trained from scratch" in card.text and "None" not in card.text.split("## Training")[0]
    assert (output_dir / "preprocessor_config.json").is_file() and (
        output_dir / "report" / "confusion_matrix.png"
    ).is_file()


# --- the data ML engineers bring: Hub-dataset shapes, odd modes, processors that cannot feed the model ----------


@pytest.fixture(scope="module")
def tiny_vit(tmp_path_factory):
    return make_tiny_vit(tmp_path_factory.mktemp("tiny-vit"))


def prepared(monkeypatch, raw, *argv):
    """scripts/train_image.py's parse_args and prepare_data on `raw`, as its DATA section would return it."""
    from accelerate import PartialState

    from conftest import load_script

    PartialState(cpu=True)  # the script logs through Accelerate
    script = load_script("train_image")
    monkeypatch.setattr(script, "load_raw_datasets", lambda args: raw)
    args = script.parse_args([str(a) for a in (*argv, "--dataset_name", "stand-in", "--report_to", "none")])
    return args, script.prepare_data(args)


def collated(args, data, split="train"):
    """Every image of `split` through the collator the script builds (unaugmented), as one batch."""
    from ddp_utils.data.vision import ImageCollator

    collate = ImageCollator(data[1], args.image_column, args.label_column, 3)
    return collate(list(data[0][split]))


def hub_split(labels, feature=None, seed=0, image_column="image", label_column="label"):
    """A datasets.Dataset built in memory as Hub image datasets are: PIL images of the class named by each label
    (a name, or an id of `feature`'s names), in class order."""
    import datasets

    rng = random.Random(seed)
    kinds = [feature.int2str(label) if isinstance(label, int) and feature else label for label in labels]
    features = datasets.Features({image_column: datasets.Image(), label_column: feature or datasets.Value("string")})
    images = [class_image({"a": "dark", "b": "bright"}.get(kind, "striped"), rng) for kind in kinds]
    return datasets.Dataset.from_dict({image_column: images, label_column: labels}, features=features)


@pytest.mark.fast
def test_pixel_arrays_of_integers_keep_their_values():
    """MNIST read with NumPy or pandas is int64: datasets stores such arrays as 32-bit images (I), and in_mode
    scaled every I image as 16-bit values: every pixel 0 or 1, a run at chance reported as a success."""
    import datasets

    from ddp_utils.data.vision import in_mode

    pixels = np.random.default_rng(0).integers(0, 256, (28, 28))
    for dtype in (np.int64, np.int32):
        features = datasets.Features({"image": datasets.Image()})
        image = datasets.Dataset.from_dict({"image": [pixels.astype(dtype)]}, features=features)[0]["image"]
        assert image.mode == "I", image.mode
        np.testing.assert_array_equal(np.asarray(in_mode(image, "L")), pixels.astype(np.uint8), err_msg=str(dtype))
    # A 16-bit file opens as I;16: scaled whatever its brightest pixel, so a dim scan is not read 257 times brighter
    dim = Image.fromarray(np.full((4, 4), 200, dtype=np.uint16))
    assert dim.mode == "I;16" and np.asarray(in_mode(dim, "L")).max() == 1


@pytest.mark.fast
def test_a_cielab_tiff_is_converted_not_a_traceback_at_the_first_step(tmp_path):
    """Pillow opens a CIELab TIFF (print and photo pipelines) as LAB, which it converts to nothing else: the check of
    every image passed, and the collator failed in the middle of the first epoch."""
    from PIL import ImageCms

    from ddp_utils.data.vision import in_mode

    rgb = class_image("striped", random.Random(0)).convert("RGB")
    to_lab = ImageCms.buildTransform(ImageCms.createProfile("sRGB"), ImageCms.createProfile("LAB"), "RGB", "LAB")
    ImageCms.applyTransform(rgb, to_lab).save(tmp_path / "scan.tif")
    scan = Image.open(tmp_path / "scan.tif")
    assert scan.mode == "LAB"
    back = np.asarray(in_mode(scan, "RGB"), dtype=int)
    assert np.abs(back - np.asarray(rgb, dtype=int)).max() <= 3
    assert in_mode(scan, "L").mode == "L"


@pytest.mark.fast
def test_a_hub_dataset_of_file_paths_or_pixel_arrays_trains_and_other_columns_are_refused(
    tmp_path, monkeypatch, tiny_vit
):
    """An image column of paths (a CSV of file names, datasets' own path column): the check read the files, and
    the collator then met a path where it expected an image, a traceback at the first step. Pixel arrays (lists)
    are read as images too; numbers, or relative paths not found from here, are refused in one line."""
    import datasets

    from ddp_utils.core.errors import UsageError
    from ddp_utils.data.image_columns import image_columns

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    folder = write_image_folder(tmp_path / "train", {"dark": 4, "bright": 4}, seed=0)
    paths = sorted(str(path) for path in folder.rglob("*.png"))
    rows = {"image": paths, "label": [os.path.basename(os.path.dirname(path)) for path in paths]}
    raw = datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows)})
    args, data = prepared(monkeypatch, raw, "--model_name_or_path", tiny_vit, "--output_dir", tmp_path / "out")
    batch = collated(args, data)
    assert batch["pixel_values"].shape == (len(data[0]["train"]), 3, 16, 16)

    arrays = datasets.Dataset.from_dict({"image": [np.full((6, 6), 200).tolist()] * 2, "label": ["a", "b"]})
    image = image_columns(datasets.DatasetDict({"train": arrays}), "image", "label")["train"][0]["image"]
    assert image.size == (6, 6) and np.asarray(image).max() == 200

    cases = {
        "counts": ([1, 2], "holds Value('int64'), not images (files, paths, pixel arrays); name the image column"),
        "relative": (["img/1.png", "img/2.png"], "holds file paths, and none of its first 2 exists from the working"),
    }
    for values, expected in cases.values():
        split = datasets.Dataset.from_dict({"image": values, "label": ["a", "b"]})
        with pytest.raises(UsageError, match=re.escape(expected)):
            image_columns(datasets.DatasetDict({"train": split}), "image", "label")


@pytest.mark.fast
def test_class_names_read_as_large_strings_become_class_ids(tmp_path, monkeypatch, tiny_vit):
    """datasets 5 reads the text of CSV, JSON and Parquet files as large_string, and its map keeps that type: the
    class ids were written back as '0', '1', ..., and the first batch failed ("too many dimensions 'str'")."""
    import datasets
    import pyarrow as pa

    def split(labels, seed):
        images = hub_split(labels, seed=seed).remove_columns("label")
        return images.add_column("label", pa.array(labels, pa.large_string()))

    raw = datasets.DatasetDict({"train": split(["a", "b", "c"] * 2, 0), "validation": split(["c", "a"], 1)})
    assert raw["train"].features["label"] == datasets.Value("large_string")
    args, data = prepared(monkeypatch, raw, "--model_name_or_path", tiny_vit, "--output_dir", tmp_path / "out")
    assert data[0]["validation"]["label"] == [2, 0]
    assert collated(args, data)["labels"].tolist() == [["a", "b", "c"].index(x) for x in ["a", "b", "c"] * 2]


@pytest.mark.fast
def test_validation_labels_numbered_otherwise_than_trainings_are_renumbered_by_name(tmp_path, monkeypatch, tiny_vit):
    """Each split read with its own ClassLabel (imagefolder on a validation folder that lacks a class): the
    validation ids were read as the training ones, its 'c' scored as 'b'. A ClassLabel beside names failed with a
    traceback, or was refused as labels never seen in training."""
    import datasets

    three, two = datasets.ClassLabel(names=["a", "b", "c"]), datasets.ClassLabel(names=["a", "c"])
    cases = {
        "two ClassLabels": (hub_split([0, 1, 2] * 3, three), hub_split([0, 1, 1], two, seed=1)),
        "ClassLabel, names": (hub_split([0, 1, 2] * 3, three), hub_split(["a", "c", "c"], seed=1)),
        "names, ClassLabel": (hub_split(["a", "b", "c"] * 3), hub_split([0, 2, 2], three, seed=1)),
    }
    for case, (train, validation) in cases.items():
        raw = datasets.DatasetDict({"train": train, "validation": validation})
        args, data = prepared(monkeypatch, raw, "--model_name_or_path", tiny_vit, "--output_dir", tmp_path / "out")
        names = data[2].id2label
        assert [names[i] for i in data[0]["validation"]["label"]] == ["a", "c", "c"], case


@pytest.mark.fast
def test_max_samples_of_a_hub_dataset_in_class_order_take_every_class(tmp_path, monkeypatch, tiny_vit):
    """A Hub dataset pushed from class folders is in class order: --max_train_samples 12 took 12 images of its
    first class, refused as "one class only" (a classifier needs two), and --max_eval_samples scored one class."""
    import datasets

    names = datasets.ClassLabel(names=["a", "b", "c"])
    labels = [0] * 20 + [1] * 20 + [2] * 20
    raw = datasets.DatasetDict({"train": hub_split(labels, names), "validation": hub_split(labels, names, seed=1)})
    args, data = prepared(
        monkeypatch, raw, "--model_name_or_path", tiny_vit, "--output_dir", tmp_path / "out",
        "--max_train_samples", 12, "--max_eval_samples", 9,
    )  # fmt: skip
    assert (len(data[0]["train"]), len(data[0]["validation"])) == (12, 9)
    assert set(data[0]["train"]["label"]) == set(data[0]["validation"]["label"]) == {0, 1, 2}


@pytest.mark.fast
def test_an_image_processor_that_cannot_feed_the_model_is_refused_before_training(tmp_path, tiny_vit, monkeypatch):
    """A 1-channel model with ImageNet's 3-value mean, or with a processor that converts to RGB, and a 4-channel
    model: a traceback at the first step. A processor that keeps the aspect ratio (a shortest-edge resize without
    a crop) could not stack a batch of wide and tall images: each is now cropped to its centred square, as
    transformers' run_image_classification.py does."""
    import datasets
    from accelerate import PartialState
    from transformers import BitImageProcessor, ViTImageProcessor

    from ddp_utils.core.errors import UsageError
    from ddp_utils.data.vision import ImageCollator, check_image_processor

    PartialState(cpu=True)
    refused = {
        "normalises 3 channels (image_mean [0.5, 0.5, 0.5]) and the model takes 1": (ViTImageProcessor(), 1),
        "converts every image to RGB (do_convert_rgb) and the model takes 1 channel (num_channels in its config.json)"
        ": set do_convert_rgb to false": (BitImageProcessor(image_mean=[0.5], image_std=[0.5]), 1),
        "the model takes 4-channel images": (ViTImageProcessor(), 4),
    }
    for expected, (processor, channels) in refused.items():
        with pytest.raises(UsageError, match=re.escape(expected)):
            check_image_processor(processor, channels)
    # In the script: before any image is read (checking ImageNet's images takes about 100 minutes)
    grey = tmp_path / "grey-vit"
    shutil.copytree(tiny_vit, grey)
    config = json.loads((grey / "config.json").read_text())
    (grey / "config.json").write_text(json.dumps({**config, "num_channels": 1}))
    # a path that is not there: read first, it would be refused as such
    images_read = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"image": ["never"], "label": ["a"]})})
    with pytest.raises(UsageError, match=re.escape("normalises 3 channels (image_mean [0.5, 0.5, 0.5])")):
        prepared(monkeypatch, images_read, "--model_name_or_path", grey, "--output_dir", tmp_path / "out")
    assert check_image_processor(ViTImageProcessor(size={"height": 16, "width": 16}), 3) is False
    assert check_image_processor(ViTImageProcessor(do_resize=False), 3) is False  # images of one size: as given
    keeps_ratio = ViTImageProcessor(size={"shortest_edge": 16})
    assert check_image_processor(keeps_ratio, 3) is True
    rng = random.Random(0)
    rows = [{"image": class_image("dark", rng).resize(size), "label": 0} for size in ((30, 12), (12, 30), (14, 14))]
    with pytest.raises(ValueError):
        ImageCollator(keeps_ratio, "image", "label", 3)(rows)
    assert ImageCollator(keeps_ratio, "image", "label", 3, square=True)(rows)["pixel_values"].shape == (3, 3, 16, 16)


@pytest.mark.fast
def test_an_image_over_pillows_size_limit_names_its_fix_and_a_raised_limit_checks_again(tmp_path, monkeypatch):
    """A gigapixel scan is whole, but over Pillow's decompression-bomb limit: it was called unreadable ("fix or
    remove them"), and after the limit was raised the cached answer still called it so."""
    import datasets
    from PIL import Image as PILImage

    from ddp_utils.core.errors import UsageError
    from ddp_utils.data.image_folders import drop_bad_images, image_folders

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(PILImage, "MAX_IMAGE_PIXELS", 30 * 30)  # refused over twice that: a 60x60 image
    train = write_image_folder(tmp_path / "train", {"dark": 3, "bright": 3}, seed=0)
    class_image("dark", random.Random(1)).resize((60, 61)).save(train / "dark" / "scan.png")
    with pytest.raises(UsageError, match=re.escape("1 train image(s) are over Pillow's limit of 1,800 pixels")) as no:
        drop_bad_images(image_folders(str(train)), "image", skip=False)
    assert "dark/scan.png" in str(no.value) and "raise PIL.Image.MAX_IMAGE_PIXELS in load_raw_datasets" in str(no.value)
    monkeypatch.setattr(PILImage, "MAX_IMAGE_PIXELS", 60 * 61)
    assert drop_bad_images(image_folders(str(train)), "image", skip=False) == {"train_images_skipped": 0}


def test_a_csv_of_image_paths_of_mixed_shapes_trains_on_two_processes_each_image_once(tmp_path):
    """Shapes users bring through --dataset_name: a folder of train.csv and validation.csv naming image files and
    their classes, wide and tall images, and a model whose image processor keeps the aspect ratio. Each failed at
    the first step; now 2 processes train, see every training image once per epoch and score each of the 13
    validation images once."""
    from transformers import ViTImageProcessor

    model = make_tiny_vit(tmp_path / "vit")
    ViTImageProcessor(size={"shortest_edge": 16}, image_mean=[0.5] * 3, image_std=[0.5] * 3).save_pretrained(model)
    rng, data = random.Random(0), tmp_path / "data"
    for split, count in (("train", 24), ("validation", 13)):
        (tmp_path / "images" / split).mkdir(parents=True)
        lines = ["image,label"]
        for i in range(count):
            kind = CLASSES[i % 3]
            path = tmp_path / "images" / split / f"{i}.jpg"
            class_image(kind, rng).convert("RGB").resize((28, 14) if i % 2 else (14, 28)).save(path)
            lines.append(f"{path},{kind}")
        data.mkdir(exist_ok=True)
        (data / f"{split}.csv").write_text("\n".join(lines) + "\n")
    output_dir = tmp_path / "out"
    args = [
        "--model_name_or_path", model, "--dataset_name", data, "--output_dir", output_dir, "--num_train_epochs", 2,
        "--per_device_train_batch_size", 4, "--per_device_eval_batch_size", 4, "--checkpointing_steps", "no",
        "--report_to", "none",
    ]  # fmt: skip
    result = launch(TRAIN_IMAGE, *args, num_processes=2)
    assert result.returncode == 0, result.output[-4000:]
    assert "keeps each image's aspect ratio (size {'shortest_edge': 16}, no crop)" in result.output
    metrics = json.loads((output_dir / "metrics.json").read_text())
    assert (metrics["eval_examples"], metrics["train_samples_seen"]) == (13, 2 * 24)
    confusion = json.loads((output_dir / "report" / "confusion_matrix.json").read_text())
    assert np.sum(confusion["counts"]) == 13 and confusion["labels"] == sorted(CLASSES)


# --- what the sweep of the families users bring found (tests/test_families_images.py, FAMILY_SWEEP=1) ------------


def test_a_model_with_parameters_off_the_logits_trains_on_two_processes_as_on_one(images, tmp_path):
    """A classifier's DINOv2 mask token (pre-training only), CLIP's post-layernorm and SigLIP's attention-pooling head
    (the classifier reads the mean of the patch tokens) get no gradient: DDP expects one for every parameter, and the
    run stopped at its second step with a traceback ("Expected to have finished reduction in the prior iteration").
    Now DDP is told to expect them: 2 processes train what 1 trains, and leave them as 1 does (weight decay
    included: SigLIP's head is in the decayed group)."""

    model = make_family_model("siglip", tmp_path / "siglip")
    unused = [name for name in weights(model) if name.startswith("vision_model.head.")]
    runs = {}
    for layout, (num_processes, extra) in LAYOUTS.items():
        runs[layout] = tmp_path / layout
        result = launch(TRAIN_IMAGE, *image_args(model, images, runs[layout], *extra), num_processes=num_processes)
        assert result.returncode == 0, result.output[-4000:]
    assert "11 parameter(s) never reach the logits (vision_model.head.probe, " in result.output
    initial, reference, other = weights(model), weights(runs["one_process"]), weights(runs["two_processes"])
    for name in unused:
        np.testing.assert_array_equal(other[name], initial[name], err_msg=name)
        np.testing.assert_array_equal(reference[name], initial[name], err_msg=name)
    for key in reference:
        if key.endswith("k_proj.bias"):  # its exact gradient is zero: rounding noise (see the ViT's comparison)
            assert np.abs(other[key]).max() < 1e-3 and np.abs(reference[key]).max() < 1e-3, key
            continue
        np.testing.assert_allclose(other[key], reference[key], rtol=1e-4, atol=1e-5, err_msg=key)


@pytest.mark.fast
def test_parameters_off_the_logits_are_found_and_a_model_that_cannot_take_its_processors_size_is_refused(tmp_path):
    """One forward pass on a blank image, before training, in eval mode (no BatchNorm statistics move): the
    parameters the logits never reach, per family; and a processor whose size is not the model's image_size, which
    failed at the first step with a traceback ("Input image size (48*48) doesn't match model (32*32)")."""
    from PIL import Image as PILImage
    from transformers import AutoImageProcessor, AutoModelForImageClassification, ViTImageProcessor

    from ddp_utils.core.errors import UsageError
    from ddp_utils.data.vision import parameters_off_the_logits

    expected = {
        "dinov2": ["dinov2.embeddings.mask_token"],
        "clip": ["vision_model.post_layernorm.weight", "vision_model.post_layernorm.bias"],
        "vit": [],
        "mobilevit": [],  # BatchNorm: eval mode leaves its statistics as they are
    }
    for family, names in expected.items():
        directory = make_family_model(family, tmp_path / family)
        model = AutoModelForImageClassification.from_pretrained(directory).train()
        processor = AutoImageProcessor.from_pretrained(directory)
        pixels = processor([PILImage.new("RGB", (40, 20), 128)], return_tensors="pt")["pixel_values"]
        before = {name: value.clone() for name, value in model.state_dict().items()}
        assert parameters_off_the_logits(model, pixels) == names, family
        assert model.training, "the model is given back in training mode"
        assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items()), family
    vit = AutoModelForImageClassification.from_pretrained(tmp_path / "vit")
    bigger = ViTImageProcessor(size={"height": 48, "width": 48})([PILImage.new("RGB", (48, 48))], return_tensors="pt")
    shown = "the model fails on one blank image as its image processor makes it, (1, 3, 48, 48) pixel values: Value"
    with pytest.raises(UsageError, match=re.escape(shown) + ".*make preprocessor_config.json's size the image_size"):
        parameters_off_the_logits(vit, bigger["pixel_values"])


@pytest.mark.fast
def test_a_model_without_an_image_classifier_or_processor_is_refused_in_one_line_and_siglips_channels_are_read(
    tmp_path, monkeypatch
):
    """A path that is not there, a model directory without preprocessor_config.json (or a broken one), CLIP's vision
    tower saved alone (CLIPVisionModel), a text model: each was a traceback (OSError, "Unrecognized configuration
    class"). And a 1-channel SigLIP or CLIP, which keeps num_channels in its vision_config: the script read 3 from
    the top level and refused its 1-channel processor."""
    import datasets
    import transformers

    from conftest import make_tiny_model, refused_in_process

    train = write_image_folder(tmp_path / "train", {"dark": 3, "bright": 3}, seed=0)
    no_processor = make_family_model("vit", tmp_path / "no-processor")
    os.remove(no_processor / "preprocessor_config.json")
    broken = make_family_model("vit", tmp_path / "broken-processor")
    (broken / "preprocessor_config.json").write_text('{"size": ')  # cut short: an OSError too, not a missing file
    tower = tmp_path / "clip-vision"
    transformers.CLIPVisionModel(transformers.CLIPVisionConfig(image_size=32, patch_size=8, **ENCODER)).save_pretrained(
        tower
    )
    cases = {
        tmp_path / "nope": "is neither a local model directory nor a Hub model id; check the path",
        no_processor: "has no image processor (preprocessor_config.json), which says how to resize and normalise",
        broken: "its image processor does not load (OSError: ",
        tower: "is a 'clip_vision_model' model, for which transformers has no image classifier "
        "(AutoModelForImageClassification); it is the vision tower of a 'clip' model saved alone: give the whole",
        make_tiny_model(tmp_path / "bert"): "is a 'bert' model, for which transformers has no image classifier",
    }
    for model, expected in cases.items():
        args = ["--model_name_or_path", model, "--train_dir", train, "--output_dir", tmp_path / "out"]
        refused_in_process("train_image", args, expected)

    grey = tmp_path / "grey-siglip"
    config = transformers.SiglipConfig(
        vision_config=dict(image_size=32, patch_size=8, num_channels=1, **ENCODER), text_config=dict(vocab_size=64)
    )
    transformers.SiglipForImageClassification(config).save_pretrained(grey)
    transformers.SiglipImageProcessor(
        size={"height": 32, "width": 32}, image_mean=[0.5], image_std=[0.5], do_convert_rgb=False
    ).save_pretrained(grey)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    raw = datasets.DatasetDict({"train": hub_split(["a", "b"] * 3)})
    args, data = prepared(monkeypatch, raw, "--model_name_or_path", grey, "--output_dir", tmp_path / "out")
    from ddp_utils.data.vision import ImageCollator, model_channels

    assert model_channels(data[2]) == 1
    pixels = ImageCollator(data[1], "image", "label", 1)(list(data[0]["train"]))["pixel_values"]
    assert pixels.shape == (len(data[0]["train"]), 1, 32, 32)

#!/usr/bin/env python
"""Fine-tune a `transformers` image classifier, on one process or many, with Accelerate.

    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml scripts/train_image.py
    accelerate launch --config_file accelerate_configs/multi_gpu_bf16.yaml scripts/train_image.py \\
        --model_name_or_path microsoft/resnet-18 --dataset_name beans --label_column labels --sync_batchnorm

With no arguments it runs the offline demo: a small ResNet (BatchNorm inside) built from
models/demo-resnet and trained from scratch on scikit-learn's 1,797 handwritten 8x8 digits.
For your own images, pass --train_dir (one subfolder per class) and --validation_dir, or edit
`load_raw_datasets` in the DATA section below.
"""

import argparse

import datasets
import torch
from accelerate.logging import get_logger
from transformers import AutoConfig, AutoImageProcessor, AutoModelForImageClassification, get_linear_schedule_with_warmup

import ddp_utils
from ddp_utils import UsageError
from ddp_utils.demo import demo_resnet_path, load_demo_digits
from ddp_utils.vision import EXAMPLE_ID, ImageCollator, check_sync_batchnorm, convert_sync_batchnorm, drop_bad_images

logger = get_logger(__name__)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # Model and data. Nothing given: the demo ResNet (from scratch) on scikit-learn's digits.
    p.add_argument("--model_name_or_path", default=None, help="Hub model id or local directory (default: the demo ResNet, from scratch)")
    p.add_argument("--dataset_name", default=None, help="Hub dataset name, e.g. beans or fashion_mnist")
    p.add_argument("--dataset_config_name", default=None, help="Hub dataset configuration")
    p.add_argument("--train_dir", default=None, help="local training images, one subfolder per class (train/cat/1.jpg, ...)")
    p.add_argument("--validation_dir", default=None, help="local validation images, same layout (default: split off the training images)")
    p.add_argument("--validation_split_percentage", type=int, default=15, help="%% of the training images held out when there is no validation split")
    p.add_argument("--image_column", default="image", help="the image column")
    p.add_argument("--label_column", default="label", help="the label column (beans calls it 'labels')")
    p.add_argument("--augment", choices=["shift", "shift+flip", "none"], default="shift",
                   help="training augmentation: random shifts of up to 1/8 of the size, and left-right flips")
    p.add_argument("--skip_bad_images", action="store_true", help="train without unreadable images (counted in the report) instead of stopping")
    p.add_argument("--sync_batchnorm", action="store_true", help="BatchNorm over the global batch, not each process's (GPUs only)")
    p.add_argument("--max_train_samples", type=int, default=None, help="use only the first N training images (quick runs)")
    p.add_argument("--max_eval_samples", type=int, default=None, help="use only the first N validation images")
    ddp_utils.add_training_args(p, learning_rate=None, per_device_train_batch_size=32, per_device_eval_batch_size=64,
                                num_train_epochs=None, output_dir="outputs/train_image")
    args = p.parse_args(argv)

    args.demo_model = args.model_name_or_path is None
    if args.learning_rate is None:  # what usually works: fine-tuning a pretrained model, or the demo from scratch
        args.learning_rate = 3e-3 if args.demo_model else 5e-5
    if args.num_train_epochs is None:
        args.num_train_epochs = 10 if args.demo_model else 3
    ddp_utils.check_training_args(args)
    ddp_utils.check_positive(args, "max_train_samples", "max_eval_samples")
    if args.validation_dir and not args.train_dir:
        raise UsageError("--validation_dir needs --train_dir")
    if args.dataset_name and args.train_dir:
        raise UsageError("give either --dataset_name or --train_dir, not both")
    if not 0 < args.validation_split_percentage < 100:
        raise UsageError(f"--validation_split_percentage must be between 1 and 99, got {args.validation_split_percentage}")
    return args


# ==================================== DATA ====================================
# The one place to edit for your own dataset: return a DatasetDict with a "train" split (and
# "validation" or "test" if you have one) holding the image column (PIL images) and the label column.
def load_raw_datasets(args):
    if args.train_dir:
        folders = {"train": f"{args.train_dir}/**", **({"validation": f"{args.validation_dir}/**"} if args.validation_dir else {})}
        return datasets.load_dataset("imagefolder", data_files=folders)
    if args.dataset_name:
        return datasets.load_dataset(args.dataset_name, args.dataset_config_name)
    return load_demo_digits()  # offline demo: 1,437 train / 360 validation digits, 8x8 grey
# ==============================================================================


def check_and_split(raw, args):
    """Refuse data the run cannot use, with the fix; take "test" as validation, or hold some out."""
    if "train" not in raw:
        raise UsageError(f"the data has no 'train' split (it has {sorted(raw)}); give --train_dir or --dataset_name")
    train = raw["train"]
    if args.train_dir and (args.label_column not in train.column_names or train.with_format("arrow")[args.label_column].null_count):
        raise UsageError(f"--train_dir {args.train_dir!r} holds images of one class only (its images are not in class subfolders); "
                         "a classifier needs at least two: put each class's images in its own subfolder (train/cat/*.jpg, train/dog/*.jpg, ...)")
    raw = datasets.DatasetDict(raw)
    if "validation" not in raw and "test" in raw:
        raw["validation"] = raw["test"]
    if "validation" not in raw:
        held_out = max(1, round(len(raw["train"]) * args.validation_split_percentage / 100))
        stratify = args.label_column if isinstance(raw["train"].features.get(args.label_column), datasets.ClassLabel) else None
        parts = raw["train"].train_test_split(test_size=held_out, seed=args.seed, stratify_by_column=stratify)
        raw = datasets.DatasetDict({"train": parts["train"], "validation": parts["test"]})
    columns = {args.image_column: "--image_column", args.label_column: "--label_column"}
    data_options = "--train_dir/--validation_dir or --dataset_name"
    return ddp_utils.check_splits(raw, columns, {"train": args.max_train_samples, "validation": args.max_eval_samples}, data_options)


def prepare_data_and_model(args):
    """Load and check the images (every one decoded once), the labels, the model and its image
    processor. Runs on the main process first."""
    raw = check_and_split(load_raw_datasets(args), args)
    skipped = drop_bad_images(raw, args.image_column, args.skip_bad_images)
    label_names, to_label_id = ddp_utils.label_mapping(raw, args.label_column)
    if to_label_id is not int:  # labels given as strings: their ids (reads the label column only, not the images)
        raw = raw.map(lambda label: {args.label_column: to_label_id(label)}, input_columns=[args.label_column], desc="Label ids")
    labels = ddp_utils.label_config(label_names)
    processor_path = demo_resnet_path() if args.demo_model else args.model_name_or_path
    image_processor = AutoImageProcessor.from_pretrained(processor_path)
    if args.demo_model:  # random weights: the same on every rank (same seed)
        model = AutoModelForImageClassification.from_config(AutoConfig.from_pretrained(demo_resnet_path(), **labels))
    else:
        config = ddp_utils.load_model_config(args.model_name_or_path, **labels)
        model = AutoModelForImageClassification.from_pretrained(args.model_name_or_path, config=config, ignore_mismatched_sizes=True)
    train = raw["train"].add_column(EXAMPLE_ID, list(range(len(raw["train"]))))
    return datasets.DatasetDict({"train": train, "validation": raw["validation"]}), image_processor, model, skipped


def main():
    args = parse_args()
    accelerator = ddp_utils.start_run(args)
    if args.sync_batchnorm:
        check_sync_batchnorm(accelerator)  # before any work: SyncBatchNorm runs on GPUs only

    data, image_processor, model, skipped = ddp_utils.load_on_main_first(accelerator, prepare_data_and_model, args)
    channels = getattr(model.config, "num_channels", 3)
    train_collate = ImageCollator(image_processor, args.image_column, args.label_column, channels,
                                  augment=args.augment != "none", flip="flip" in args.augment, seed=args.seed)
    eval_collate = ImageCollator(image_processor, args.image_column, args.label_column, channels)
    train_dataloader = ddp_utils.make_train_dataloader(
        data["train"], batch_size=args.per_device_train_batch_size, accelerator=accelerator, collate_fn=train_collate
    )
    eval_dataloader = torch.utils.data.DataLoader(data["validation"], batch_size=args.per_device_eval_batch_size, collate_fn=eval_collate)
    metrics = [ddp_utils.load_metric("accuracy"), ddp_utils.load_metric("f1")]
    logger.info(f"{len(data['train'])} train / {len(data['validation'])} eval images, {model.config.num_labels} classes")
    if args.sync_batchnorm:
        model = convert_sync_batchnorm(model)  # before prepare, so DDP wraps the synchronised layers

    optimizer = ddp_utils.make_adamw(model, args.learning_rate, args.weight_decay)  # no decay on biases and norms
    run = ddp_utils.TrainingRun(accelerator, args, model, train_dataloader)  # step plan, checkpoints, resume
    lr_scheduler = get_linear_schedule_with_warmup(optimizer, round(args.warmup_ratio * run.max_train_steps), run.max_train_steps)
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )
    run.start()  # creates the output dir, starts the trackers, resumes from a checkpoint if asked to

    confusion = None
    for epoch in run.epochs():
        model.train()
        train_collate.set_epoch(epoch)  # each image's augmentation depends on (seed, epoch, image) only
        # One optimizer step per iteration: its micro-batches, and how many real images they hold on all ranks.
        for micro_batches, step_size in run.optimizer_steps(train_dataloader, epoch):
            step = ddp_utils.train_step(accelerator, model, optimizer, micro_batches, step_size,
                                        ddp_utils.classification_loss, args.max_grad_norm)
            lr_scheduler.step()
            if run.end_step(step):  # logging, checkpoints, preemption
                break
        scores, confusion = ddp_utils.evaluate_classification(accelerator, model, eval_dataloader, metrics)
        run.end_epoch(scores)
        if run.done:
            break

    ddp_utils.save_model(accelerator, model, args.output_dir, image_processor)
    run.finish(skipped, confusion=confusion)  # metrics.json, report/ with plots
    accelerator.end_training()


if __name__ == "__main__":
    ddp_utils.run(main)

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
import math

import datasets
import torch
import torch.nn.functional as F
from accelerate.logging import get_logger
from transformers import AutoConfig, AutoModelForImageClassification

import ddp_utils
from ddp_utils import SAMPLE_WEIGHT, UsageError
from ddp_utils.data.classification import CLASSIFICATION_SCORES
from ddp_utils.data.demo import demo_resnet_path, load_demo_digits
from ddp_utils.data.image_columns import image_columns
from ddp_utils.data.image_folders import drop_bad_images, image_folders
from ddp_utils.data.vision import (
    EXAMPLE_ID,
    ImageCollator,
    check_image_processor,
    check_sync_batchnorm,
    convert_sync_batchnorm,
    expect_unused_parameters,
    load_image_processor,
    model_channels,
)

logger = get_logger(__name__)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=ddp_utils.HelpFormatter)  # with defaults
    # Model and data. Nothing given: the demo ResNet (from scratch) on scikit-learn's digits.
    p.add_argument("--model_name_or_path", default=None, help="Hub model id or local directory (default: the demo's)")
    p.add_argument("--dataset_name", default=None, help="Hub dataset name, e.g. beans or fashion_mnist")
    p.add_argument("--dataset_config_name", default=None, help="Hub dataset configuration")
    p.add_argument("--train_split", default=None, help="the Hub dataset's training split (default: train)")
    p.add_argument("--validation_split", default=None, help="its validation split (default: validation, else test)")
    p.add_argument("--train_dir", default=None, help="local training images, a subfolder per class (train/cat/1.jpg)")
    p.add_argument("--validation_dir", default=None, help="local validation images, same layout (default: held out)")
    p.add_argument("--validation_split_percentage", type=int, default=15, help="%% held out without a validation split")
    p.add_argument("--image_column", default="image", help="the image column")
    p.add_argument("--label_column", default="label", help="the label column (beans calls it 'labels')")
    p.add_argument(
        "--augment",
        choices=["shift", "shift+flip", "none"],
        default="shift",
        help="training augmentation: random shifts of up to 1/8 of the size, and left-right flips",
    )
    p.add_argument("--skip_bad_images", action="store_true", help="train without unreadable images (counted) instead")
    p.add_argument("--sync_batchnorm", action="store_true", help="BatchNorm over the global batch (GPUs only)")
    p.add_argument(
        "--max_train_samples",
        type=int,
        default=None,
        help="use only N training images, of mixed classes",
    )
    p.add_argument(
        "--max_eval_samples",
        type=int,
        default=None,
        help="use only N validation images, of mixed classes",
    )
    ddp_utils.add_lora_args(p, text=False)  # --lora_r: adapters on the pretrained body, the new head trained whole
    ddp_utils.add_gradient_checkpointing_arg(p)  # for a large model: its activations recomputed in the backward pass
    ddp_utils.add_training_args(p)  # batch sizes, learning rate, checkpoints, output, tracking
    p.set_defaults(per_device_train_batch_size=32, per_device_eval_batch_size=64, output_dir="outputs/train_image")
    p.set_defaults(num_train_epochs=None, metric_for_best_model="eval_accuracy")  # epochs: set below
    args = p.parse_args(argv)

    args.demo_model = args.model_name_or_path is None
    if args.learning_rate is None:  # pretrained (with LoRA: train.py's rate), or the demo from scratch
        args.learning_rate = 3e-3 if args.demo_model else 5e-4 if args.lora_r else 5e-5
    if args.num_train_epochs is None:
        args.num_train_epochs = 10 if args.demo_model else 3
    ddp_utils.check_training_args(args)
    ddp_utils.check_lora_options(args)
    if args.lora_r and args.demo_model:
        raise UsageError("--lora_r adapts a pretrained model; the demo trains from scratch: give --model_name_or_path")
    ddp_utils.check_metric_for_best_model(args, CLASSIFICATION_SCORES)  # accuracy, f1 or loss
    ddp_utils.check_data_args(args, "train_dir", "validation_dir")
    return args


# ==================================== DATA ====================================
# The one place to edit for your own dataset: return a DatasetDict with a "train" split (and
# "validation" or "test" if you have one; else some training images are held out) holding the
# image column (PIL images, or file paths) and the label column. Your own names and labels, on what the
# --dataset_name branch below returns (or name the columns with --image_column and --label_column):
#   data = data.rename_columns({"img": "image", "kind": "label"})
#   data = data.map(lambda row: {"label": "cat" if row["label"] in ("tabby", "siamese") else "dog"})
def load_raw_datasets(args):
    if args.train_dir:
        return image_folders(args.train_dir, args.validation_dir)  # a subfolder per class; columns image, label
    if args.dataset_name:
        raw = datasets.load_dataset(args.dataset_name, args.dataset_config_name)
        return ddp_utils.named_splits(raw, args.train_split, args.validation_split)  # the Hub's own split names
    return load_demo_digits()  # offline demo: 1,437 train / 360 validation digits, 8x8 grey


# ==============================================================================


def prepare_data(args):
    """Load the image processor, checked against the model before any image is read; load and check the images
    (every one decoded once) and their labels, and the model's config (with the labels). Runs on the main process
    first, then on the others."""
    source = demo_resnet_path() if args.demo_model else args.model_name_or_path
    model_config = ddp_utils.load_model_config(source, args.trust_remote_code)  # a bad path or id: one line
    image_processor = load_image_processor(source, model_config, args.trust_remote_code)  # or why there is none
    channels = model_channels(model_config)  # CLIP and SigLIP keep it in their vision_config
    square = check_image_processor(image_processor, channels)  # before any image is read; True: crop them square
    raw = load_raw_datasets(args)
    columns = {args.image_column: "--image_column", args.label_column: "--label_column"}
    limits = {"train": args.max_train_samples, "validation": args.max_eval_samples}
    raw = ddp_utils.check_splits(
        raw,
        columns,
        "--train_dir/--validation_dir or --dataset_name",
        limits=limits,
        hold_out_percentage=args.validation_split_percentage,
        seed=args.seed,
        stratify_by=args.label_column,
        sample_limits=not args.train_dir,  # a Hub split in class order; image folders are mixed, in a stable order
    )
    raw = image_columns(raw, args.image_column, args.label_column)  # paths and pixel arrays read as images
    raw = ddp_utils.labels_numbered_as_training(raw, args.label_column)  # each split its own ClassLabel: by name
    skipped = drop_bad_images(raw, args.image_column, args.skip_bad_images)
    label_names, to_label_id = ddp_utils.label_mapping(raw, args.label_column)
    if to_label_id is not int:  # labels given as strings: their ids (reads the label column only, not the images)
        raw = raw.map(lambda label: {args.label_column: to_label_id(label)}, input_columns=[args.label_column])
    labels = ddp_utils.label_config(label_names)
    if args.demo_model:
        config = AutoConfig.from_pretrained(demo_resnet_path(), **labels)
    else:
        config = ddp_utils.load_model_config(args.model_name_or_path, args.trust_remote_code, **labels)
        ddp_utils.fetch_weights(args.model_name_or_path)  # one download; the ranks then build the model from the cache
    train = raw["train"].add_column(EXAMPLE_ID, list(range(len(raw["train"]))))
    report = {**skipped, **({"square_crops": True} if square else {})}  # recorded where it is so
    return datasets.DatasetDict({"train": train, "validation": raw["validation"]}), image_processor, config, report


def main():
    args = parse_args()
    accelerator = ddp_utils.start_run(args)
    if args.sync_batchnorm:
        check_sync_batchnorm(accelerator)  # before any work: SyncBatchNorm runs on GPUs only

    data, image_processor, config, data_report = ddp_utils.load_on_main_first(accelerator, prepare_data, args)
    channels, square = model_channels(config), data_report.get("square_crops", False)
    # Every rank builds the model at the same time: under DeepSpeed ZeRO-3 building it is a collective.
    if args.demo_model:  # random weights: the same on every rank (same seed)
        model = AutoModelForImageClassification.from_config(config)
    else:
        model = ddp_utils.load_pretrained(  # under FSDP, only rank 0 reads the weights
            AutoModelForImageClassification,
            args.model_name_or_path,
            config=config,
            ignore_mismatched_sizes=True,
            trust_remote_code=args.trust_remote_code,
        )  # a new head
    ddp_utils.checkpoint_if_asked(model, args)  # --gradient_checkpointing: activations recomputed, not kept
    model = ddp_utils.add_classifier_lora(model, args)  # --lora_r: adapters on the body, the new head trains whole
    ddp_utils.train_in_fp32(accelerator, model)  # AdamW on bf16 weights would lose small updates
    # One forward pass on a blank image: a model that cannot take its processor's output is refused now, and DDP is
    # told of parameters that never reach the logits (DINOv2's mask token, CLIP's and SigLIP's unused pooling).
    expect_unused_parameters(accelerator, model, image_processor, channels)
    train_collate = ImageCollator(
        image_processor,
        args.image_column,
        args.label_column,
        channels,
        augment=args.augment != "none",
        flip="flip" in args.augment,
        seed=args.seed,
        square=square,
    )
    eval_collate = ImageCollator(image_processor, args.image_column, args.label_column, channels, square=square)
    # epoch_in_rows: each image's augmentation depends on (seed, epoch, image) only, in any loader worker
    train_dataloader = ddp_utils.make_train_dataloader(
        data["train"], args, accelerator, train_collate, epoch_in_rows=True
    )
    eval_dataloader = ddp_utils.make_eval_dataloader(data["validation"], args, eval_collate)
    metrics = [ddp_utils.load_metric("accuracy"), ddp_utils.load_metric("f1")]
    logger.info(f"{len(data['train'])} train / {len(data['validation'])} eval images, {config.num_labels} classes")
    if args.sync_batchnorm:
        model = convert_sync_batchnorm(model)  # before prepare, so DDP wraps the synchronised layers

    optimizer = ddp_utils.make_adamw(model, args.learning_rate, args.weight_decay)  # no decay on biases and norms
    plan = ddp_utils.StepPlan(accelerator, args, train_dataloader)  # how many steps and epochs; where the run is
    lr_scheduler = ddp_utils.make_lr_scheduler(optimizer, args, plan.max_train_steps)
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )
    checkpointer, log, backoff = ddp_utils.start_training(accelerator, args, model, optimizer, plan)  # all ranks

    def evaluate():  # all ranks: the scores on the whole eval set, each image once, and the confusion matrix
        return ddp_utils.evaluate_classification(accelerator, model, eval_dataloader, metrics)

    def forward_backward(micro_batches, step_size):  # this rank's share of one optimizer step
        loss_sum = torch.zeros((), device=accelerator.device)
        for batch in micro_batches:
            with accelerator.accumulate(model):  # DDP syncs the gradients on the last micro-batch only
                weights, labels = batch.pop(SAMPLE_WEIGHT), batch.pop("labels")
                losses = F.cross_entropy(model(**batch).logits.float(), labels, reduction="none")  # one per image
                # The mean over the step's images on all ranks, not over this micro-batch.
                accelerator.backward(ddp_utils.global_mean_loss(losses, weights, step_size.weight, accelerator))
                loss_sum += (losses.detach() * weights).sum()
        return loss_sum

    # Calls marked "all ranks" are collectives: every rank makes them, in the same order. Never make
    # one under `if accelerator.is_main_process`, and never leave the loop on one rank alone.
    scores, confusion = {}, None
    for epoch in plan.epochs():
        model.train()
        for micro_batches in plan.optimizer_steps(train_dataloader, epoch):
            step_size = ddp_utils.count_step(accelerator, micro_batches)  # all ranks: what the whole step holds
            loss_sum = backoff.run(forward_backward, micro_batches, step_size)  # --oom_backoff: in halves after OOM
            grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm or math.inf)  # all ranks
            optimizer.step()
            optimizer.zero_grad()
            learning_rate = lr_scheduler.get_last_lr()[0]  # the rate this step used
            lr_scheduler.step()
            plan.advance(step_size)  # count the step; no communication
            log.step(plan, loss_sum, grad_norm, learning_rate)  # all ranks: every --logging_steps a record
            if plan.evaluation_due():  # every --eval_steps steps
                scores, confusion = evaluate()  # all ranks
                log.evaluation(plan, scores)
            checkpointer.step(plan)  # all ranks: stops for a preemption signal, saves when due
            if plan.done:
                break
        scores, confusion = evaluate()  # all ranks
        plan.end_epoch()
        log.evaluation(plan, scores)
        checkpointer.epoch(plan)  # all ranks: saves when due
        if plan.done:
            break

    log.close()
    ddp_utils.save_with_merged(accelerator, model, args, image_processor)  # all ranks; LoRA: the adapter, merged/ too
    facts = {**data_report, **backoff.facts(), **checkpointer.facts()}
    ddp_utils.write_results(accelerator, args, plan, scores, facts, confusion=confusion)  # all ranks: metrics.json
    accelerator.end_training()


if __name__ == "__main__":
    ddp_utils.run(main)

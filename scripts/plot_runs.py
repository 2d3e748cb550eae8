#!/usr/bin/env python
"""Compare runs: draw the curves of one or more output directories on shared axes, one line per run.

    python scripts/plot_runs.py outputs/train outputs/train-lr3e-4 --out compare.png
    python scripts/plot_runs.py outputs/* --keys train/loss train/samples_per_second eval/accuracy

It reads each run's train_log.jsonl (written by every script in scripts/), so no tracker is needed.
Keys are the names in train_log.jsonl: train/* are drawn against optimizer steps, eval/* against epochs.
"""

import argparse
import os

from ddp_utils.results.report import plot_runs
from ddp_utils.training.training_log import TRAIN_LOG


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("output_dirs", nargs="+", help="output directories of finished (or running) runs")
    p.add_argument("--out", default="runs.png", help="the PNG to write")
    p.add_argument("--keys", nargs="+", default=None, help="what to draw (default: train/loss and every eval score)")
    p.add_argument(
        "--names", nargs="+", default=None, help="legend names, one per directory (default: the directory names)"
    )
    args = p.parse_args()
    without_log = [d for d in args.output_dirs if not os.path.isfile(os.path.join(d, TRAIN_LOG))]
    if without_log:
        p.exit(2, f"error: no {TRAIN_LOG} in {', '.join(without_log)}: give the output_dir of a run\n")
    if args.names and len(args.names) != len(args.output_dirs):
        p.exit(
            2,
            f"error: {len(args.names)} --names for {len(args.output_dirs)} directories; give one name per directory\n",
        )
    try:
        keys = plot_runs(args.output_dirs, args.out, keys=args.keys, names=args.names)
    except ValueError as error:
        p.exit(2, f"error: {error}\n")
    print(f"{args.out}: {', '.join(keys)} for {len(args.output_dirs)} run(s)")


if __name__ == "__main__":
    main()

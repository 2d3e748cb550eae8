#!/usr/bin/env python
"""Benchmark: making token rows into training blocks (`ddp_utils.language_models.token_blocks`).

Side by side on the same tokenized rows (random ids, 50 to 449 tokens a row), each way in chunks of
10,000 rows through `datasets.map`, no cache:

- raw text cut into blocks of 1,024 (train_clm.py): ours (`text_blocks`, Arrow and NumPy, one process)
  against the per-token Python loop that it replaced, which is how the Transformers `run_clm` examples
  group texts, on 1 process and on `--num_proc` processes;
- whole examples packed into rows of 2,048 (train_sft.py --packing): ours (`packed_examples`) against
  the loop that it replaced (the same best fit, rows assembled token by token in Python).

Every way must give the same rows as ours on one process (on several processes the loops give other
rows, the reason ours runs on one: see the module's docstring); the table says where they differ.

    python bench/bench_token_blocks.py [--rows 205000] [--num_proc 2]
"""

import argparse
import bisect
import time

import datasets
import numpy as np

from ddp_utils.language_models.causal_lm import IGNORE_INDEX
from ddp_utils.language_models.token_blocks import CHUNK_ROWS, packed_examples, text_blocks


def blocks_in_python(batch: dict, block_size: int) -> dict:
    """Concatenate the chunk's rows token by token and cut them into blocks (the replaced way)."""
    stream = [token for ids in batch["input_ids"] for token in ids]
    usable = len(stream) - len(stream) % block_size
    blocks = [stream[i : i + block_size] for i in range(0, usable, block_size)]
    return {"input_ids": blocks, "labels": [list(block) for block in blocks]}


def packed_in_python(batch: dict, block_size: int) -> dict:
    """Best fit decreasing, each row assembled token by token in Python (the replaced way)."""
    lengths = [len(ids) for ids in batch["input_ids"]]
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        slot = bisect.bisect_left(free, (lengths[index], -1))
        room, row = free.pop(slot) if slot < len(free) else (block_size, len(rows))
        if row == len(rows):
            rows.append([])
        rows[row].append(index)
        bisect.insort(free, (room - lengths[index], row))
    packed = {"input_ids": [], "labels": [], "position_ids": []}
    for members in rows:
        packed["input_ids"].append([token for i in members for token in batch["input_ids"][i]])
        packed["labels"].append([label for i in members for label in [IGNORE_INDEX, *batch["labels"][i][1:]]])
        packed["position_ids"].append([position for i in members for position in range(lengths[i])])
    return packed


def timed(function, *args):
    start = time.perf_counter()
    rows = function(*args)
    return time.perf_counter() - start, rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=205_000, help="tokenized rows (not a multiple of 10,000 per process)")
    p.add_argument("--num_proc", type=int, default=2, help="processes for the loops' parallel runs")
    args = p.parse_args()
    rng = np.random.default_rng(0)
    lengths = rng.integers(50, 450, size=args.rows)
    ids = [rng.integers(0, 50_000, size=n, dtype=np.int32) for n in lengths[:2000]]
    rows = datasets.Dataset.from_dict({"input_ids": [ids[i % 2000] for i in range(args.rows)]})
    rows = rows.add_column("labels", rows["input_ids"])
    tokens = int(sum(len(ids[i % 2000]) for i in range(args.rows)))
    print(f"{args.rows:,} rows, {tokens:,} tokens, chunks of {CHUNK_ROWS:,} rows")

    def python_way(function, block_size, num_proc, dataset):
        return dataset.map(
            function,
            batched=True,
            batch_size=CHUNK_ROWS,
            fn_kwargs={"block_size": block_size},
            num_proc=num_proc,
            load_from_cache_file=False,
            remove_columns=dataset.column_names,
        )

    text = rows.select_columns(["input_ids"])
    work = {
        "text into blocks of 1,024": (text, text_blocks, blocks_in_python, 1024),
        "examples packed in rows of 2,048": (rows, packed_examples, packed_in_python, 2048),
    }
    print("| work | way | seconds | M tokens/s | time × ours' | rows | the same rows as ours |")
    print("|---|---|---:|---:|---:|---:|---|")
    for name, (dataset, ours, loop, block_size) in work.items():
        seconds, reference = timed(ours, dataset, block_size)
        speed = tokens / seconds / 1e6
        print(f"| {name} | ours, 1 process | {seconds:.2f} | {speed:.1f} | 1.00 | {len(reference):,} | |")
        expected = reference[:]
        for num_proc in (None, args.num_proc):
            other, made = timed(python_way, loop, block_size, num_proc, dataset)
            same = "yes" if made[:] == expected else "**no**"
            print(
                f"| {name} | Python loop, {num_proc or 1} process(es) | {other:.2f} | {tokens / other / 1e6:.1f} | "
                f"{other / seconds:.1f} | {len(made):,} | {same} |"
            )


if __name__ == "__main__":
    main()

"""Token rows made into training blocks: raw text as one stream cut into blocks (`text_blocks`,
train_clm.py), and whole examples packed into rows (`packed_examples`, train_sft.py --packing).

Both work through the split in chunks of `CHUNK_ROWS` rows counted from its start, in the calling
process, so the blocks do not depend on how many processes prepared the data. `datasets.map` with
`num_proc` would cut the split into one shard per process and each shard into chunks of its own:
other blocks, and another number of them, for every --preprocessing_num_workers or number of cores
(which sets it by default), so a run resumed on another kind of node would train other examples
(and its checkpoint refuse it). Tokenizing, the slow part, still runs on every process; the work
here is vectorised with Arrow and NumPy (`bench/README.md` has its speed). No communication.
"""

from __future__ import annotations

import bisect

import numpy as np

from .causal_lm import IGNORE_INDEX

CHUNK_ROWS = 10_000  # rows cut or packed together: a block never spans two chunks


def text_blocks(dataset, block_size: int):
    """`dataset`'s `input_ids`, each chunk's sequences concatenated and cut into blocks of
    `block_size` tokens, as a Dataset of `input_ids` and `labels` (the same: every block is trained
    on whole). Each chunk's tail that does not fill a block is dropped; the caller reports it."""
    return _map_chunks(dataset, _cut_into_blocks, block_size, "Cutting the text into blocks")


def packed_examples(dataset, block_size: int):
    """`dataset`'s whole examples (`input_ids`, `labels`) packed into rows of at most `block_size`
    tokens, never splitting one, as a Dataset of `input_ids`, `labels` and `position_ids`. Best fit
    decreasing within each chunk: longest first, each into the row it leaves least room in, so rows
    come out nearly full (first fit in the data's order left a fifth of each row as padding on the demo).

    `position_ids` restart at 0 for every example. Given position_ids and no attention_mask,
    `transformers` models build a block-diagonal causal mask from them (and flash-attention uses
    them for variable-length kernels), so an example never attends to the one packed before it.
    The first label of each example is -100: it is not predicted from the previous example's last token.
    """
    return _map_chunks(dataset, _pack_rows, block_size, "Packing")


def _map_chunks(dataset, function, block_size: int, desc: str):
    rows = dataset.with_format("arrow").map(
        function,
        batched=True,
        batch_size=CHUNK_ROWS,
        fn_kwargs={"block_size": block_size},
        remove_columns=dataset.column_names,
        desc=desc,
    )
    return rows.with_format(dataset.format["type"])


def _list_array(offsets: np.ndarray, values):
    import pyarrow as pa

    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), values)


def _flat(column):
    """A column of token lists (an Arrow chunked array) as (its values, each list's length)."""
    import pyarrow.compute as pc

    lists = column.combine_chunks()
    return pc.list_flatten(lists), pc.list_value_length(lists).to_numpy(zero_copy_only=False).astype(np.int64)


def _cut_into_blocks(batch, block_size: int):
    import pyarrow as pa

    stream, _ = _flat(batch.column("input_ids"))
    usable = len(stream) - len(stream) % block_size
    blocks = _list_array(np.arange(0, usable + 1, block_size), stream.slice(0, usable))
    return pa.table({"input_ids": blocks, "labels": blocks})


def _pack_rows(batch, block_size: int):
    import pyarrow as pa

    ids, lengths = _flat(batch.column("input_ids"))
    labels, _ = _flat(batch.column("labels"))
    rows: list[list[int]] = []  # example indices per row
    free: list[tuple[int, int]] = []  # (room left, row), sorted
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        slot = bisect.bisect_left(free, (lengths[index], -1))  # the row with the least room that still fits
        if slot < len(free):
            room, row = free.pop(slot)
        else:
            room, row = block_size, len(rows)
            rows.append([])
        rows[row].append(index)
        bisect.insort(free, (room - lengths[index], row))
    order = np.array([index for members in rows for index in members], dtype=np.int64)
    packed_lengths = lengths[order]
    first = np.cumsum(packed_lengths) - packed_lengths  # each example's first token in the packed stream
    starts = np.cumsum(lengths) - lengths  # and in the batch's
    taken = np.arange(packed_lengths.sum()) + np.repeat(starts[order] - first, packed_lengths)
    packed_labels = labels.to_numpy(zero_copy_only=False)[taken]
    packed_labels[first[packed_lengths > 0]] = IGNORE_INDEX  # an empty example has no first label
    positions = np.arange(len(taken)) - np.repeat(first, packed_lengths)
    offsets = np.concatenate([[0], np.cumsum([lengths[members].sum() for members in rows])])
    return pa.table(
        {
            "input_ids": _list_array(offsets, ids.take(pa.array(taken))),
            "labels": _list_array(offsets, pa.array(packed_labels, type=labels.type)),
            "position_ids": _list_array(offsets, pa.array(positions, type=pa.int64())),
        }
    )

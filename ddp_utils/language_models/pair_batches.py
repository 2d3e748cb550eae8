"""A batch of preference pairs (`PairCollator`): one row per pair, trained in one forward pass that
computes its prompt once, or two rows per pair where a shared row is not exact (`pair_scoring`).
Nothing here communicates."""

from __future__ import annotations

import torch

from ..data.dataloaders import SAMPLE_WEIGHT
from ..training.exact_loss import INPUT_TOKENS
from .causal_lm import IGNORE_INDEX


class PairCollator:
    """Pairs into one batch of B rows, each [prompt, chosen answer, rejected answer], padded on the
    right: the prompt is computed once for both answers (with `two_rows`, 2B rows: `_two_rows`). The
    rejected answer does not attend to the chosen one (`attention_mask`, (B, 1, L, L), True where a
    position may attend) and its positions continue from the prompt's, so the model sees each answer
    right after the prompt, as if alone. The targets of each side sit at the positions that predict
    them (`chosen_targets`, `rejected_targets`, -100 elsewhere): the prompt's last position predicts
    the first token of both. A filler pair (SAMPLE_WEIGHT 0.0) has no targets. Per pair: SAMPLE_WEIGHT (the exact
    loss's weight), `index`, INPUT_TOKENS (its row's tokens)."""

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int | None = None, two_rows: bool = False):
        self.pad_token_id, self.pad_to_multiple_of, self.two_rows = pad_token_id, pad_to_multiple_of, two_rows

    def __call__(self, rows: list[dict]) -> dict:
        sizes = [(len(r["prompt_ids"]), len(r["chosen_ids"]), len(r["rejected_ids"])) for r in rows]
        if self.two_rows:
            return self._two_rows(rows, sizes)
        length = max(sum(size) for size in sizes)
        if self.pad_to_multiple_of:
            length = -(-length // self.pad_to_multiple_of) * self.pad_to_multiple_of
        input_ids = torch.full((len(rows), length), self.pad_token_id, dtype=torch.long)
        position_ids = torch.zeros((len(rows), length), dtype=torch.long)
        chosen_targets = torch.full((len(rows), length), IGNORE_INDEX, dtype=torch.long)
        rejected_targets = torch.full((len(rows), length), IGNORE_INDEX, dtype=torch.long)
        visible = torch.eye(length, dtype=torch.bool).repeat(len(rows), 1, 1)  # padding sees itself: no empty row
        causal = torch.ones((length, length), dtype=torch.bool).tril()
        for i, (row, (p, c, r)) in enumerate(zip(rows, sizes)):
            n = p + c + r
            input_ids[i, :n] = torch.tensor(row["prompt_ids"] + row["chosen_ids"] + row["rejected_ids"])
            position_ids[i, :n] = torch.cat([torch.arange(p + c), torch.arange(p, p + r)])
            visible[i, :n, :n] = causal[:n, :n]
            visible[i, p + c : n, p : p + c] = False  # the rejected answer never sees the chosen one
            if row.get(SAMPLE_WEIGHT, 1.0) > 0:
                chosen_targets[i, p - 1 : p + c - 1] = torch.tensor(row["chosen_ids"])
                rejected_targets[i, p - 1] = row["rejected_ids"][0]  # from the prompt's last position, as chosen's
                rejected_targets[i, p + c : n - 1] = torch.tensor(row["rejected_ids"][1:])
        return {
            "input_ids": input_ids,
            "position_ids": position_ids,
            "attention_mask": visible[:, None],
            "chosen_targets": chosen_targets,
            "rejected_targets": rejected_targets,
            SAMPLE_WEIGHT: torch.tensor([row.get(SAMPLE_WEIGHT, 1.0) for row in rows]),
            "index": torch.tensor([row["index"] for row in rows]),
            INPUT_TOKENS: torch.tensor([sum(size) for size in sizes]),
        }

    def _two_rows(self, rows: list[dict], sizes: list[tuple]) -> dict:
        """TWO_ROWS (`pair_scoring`): [prompt, chosen] in rows 0 to B-1, [prompt, rejected] in rows B to
        2B-1, each a plain causal row (`attention_mask` (2B, L), 1 on real tokens); the per-pair keys
        as in one row. For models where a shared row is not exact."""
        pairs = len(rows)
        length = max(p + max(c, r) for p, c, r in sizes)
        if self.pad_to_multiple_of:
            length = -(-length // self.pad_to_multiple_of) * self.pad_to_multiple_of
        input_ids = torch.full((2 * pairs, length), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((2 * pairs, length), dtype=torch.long)
        chosen_targets = torch.full((2 * pairs, length), IGNORE_INDEX, dtype=torch.long)
        rejected_targets = torch.full((2 * pairs, length), IGNORE_INDEX, dtype=torch.long)
        for i, (row, (p, _, _)) in enumerate(zip(rows, sizes)):
            for at, answer, targets in (
                (i, "chosen_ids", chosen_targets),
                (pairs + i, "rejected_ids", rejected_targets),
            ):
                n = p + len(row[answer])
                input_ids[at, :n] = torch.tensor(row["prompt_ids"] + row[answer])
                attention_mask[at, :n] = 1
                if row.get(SAMPLE_WEIGHT, 1.0) > 0:
                    targets[at, p - 1 : n - 1] = torch.tensor(row[answer])
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "chosen_targets": chosen_targets,
            "rejected_targets": rejected_targets,
            SAMPLE_WEIGHT: torch.tensor([row.get(SAMPLE_WEIGHT, 1.0) for row in rows]),
            "index": torch.tensor([row["index"] for row in rows]),
            INPUT_TOKENS: torch.tensor([2 * p + c + r for p, c, r in sizes]),
        }

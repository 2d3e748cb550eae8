"""How GRPO scores a group of completions: each completion token's log-probability, in one forward pass, in one
of the layouts `pair_scoring` decides between for DPO:

- **one row** per prompt, [prompt, completion 1, ..., completion G]: the prompt is computed once. Each completion
  attends to the prompt and to itself, not to the others (a 4D mask), and its positions continue the prompt's,
  so an attention layer sees each completion as if alone. The prompt's last position predicts every
  completion's first token.
- **a row per completion**, [prompt, completion] (TRL's layout): the prompt G times, but exact for any model.
  Taken where one row is not exact (`pair_scoring.choose_pair_layout`: recurrent and state-space layers, ALiBi,
  an attention that takes no custom mask).

No communication here (the model's forward pass may gather FSDP shards, on every rank alike).
"""

from __future__ import annotations

import torch

from .pair_scoring import ONE_ROW, masks_for


def completion_logps(model, rollout: dict, layout: str = ONE_ROW, temperature: float = 1.0) -> torch.Tensor:
    """Per completion token of `rollout` (rows grouped by prompt, from `grpo.sample_completions`), its
    log-probability under `model` at the sampling `temperature` (the policy the samples came from):
    (completions, completion length), 0 past each completion's end."""
    if layout == ONE_ROW:
        rows = rollout["rows"]  # from one_row_per_prompt, built once per rollout
        logits = model(
            input_ids=rows["input_ids"],
            attention_mask=masks_for(model, rows["attention_mask"], rows["position_ids"]),
            position_ids=rows["position_ids"],
            use_cache=False,
            logits_to_keep=rows["keep"],
        ).logits  # (positions kept, vocab)
        places = rows["source"]  # each completion token's predicting position among the kept ones
    else:
        input_ids = torch.cat([rollout["prompt_ids"], rollout["completion_ids"]], dim=1)
        mask = torch.cat([rollout["prompt_mask"], rollout["completion_mask"]], dim=1)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        rows, width = len(input_ids), rollout["completion_ids"].shape[1]
        logits = (
            model(
                input_ids=input_ids,
                attention_mask=mask,
                position_ids=positions,
                use_cache=False,
                logits_to_keep=width + 1,
            )
            .logits[:, :-1]
            .reshape(rows * width, -1)
        )
        places = torch.arange(rows * width, device=logits.device).view(rows, width)
    logits = logits.float() / temperature
    # The token's logit less the log-normaliser: never a (tokens, vocab) copy of the log-softmax.
    logps = logits[places, rollout["completion_ids"]] - logits.logsumexp(dim=-1)[places]
    return logps * rollout["completion_mask"]


def one_row_per_prompt(rollout: dict, group: int, pad_token_id: int, pad_to_multiple_of: int | None = None) -> dict:
    """The rows [prompt, completion 1, ..., completion G], right-padded (to a multiple of `pad_to_multiple_of`, if
    given): input_ids and position_ids (B, L), the boolean 4D mask (B, 1, L, L), `keep` (B, L): the positions that
    predict a completion token, and `source` (completions, completion length): for each completion token, its
    predicting position's place among the kept ones.

    Padded to a multiple, the rows take a few lengths instead of one per step, as SFT's and DPO's batches do under
    mixed precision: tensor cores want multiples of 8, and each new length can cost cuDNN's attention a graph built
    on the host (torchtune#1652), the lead of the GPU profile's step 12 (bench/README.md, session 4)."""
    prompt_mask, completion_mask = rollout["prompt_mask"][::group].bool(), rollout["completion_mask"].bool()
    prompts, width = len(prompt_mask), completion_mask.shape[1]
    prompt_lengths = prompt_mask.sum(dim=1)
    lengths = completion_mask.sum(dim=1).view(prompts, group)
    length = int((prompt_lengths + lengths.sum(dim=1)).max())
    if pad_to_multiple_of:
        length = -(-length // pad_to_multiple_of) * pad_to_multiple_of
    device = completion_mask.device
    input_ids = torch.full((prompts, length), pad_token_id, dtype=torch.long, device=device)
    positions = torch.zeros((prompts, length), dtype=torch.long, device=device)
    segment = torch.full((prompts, length), -1, dtype=torch.long, device=device)  # 0: prompt, k + 1: completion k
    predictor = torch.zeros((prompts, group, width), dtype=torch.long, device=device)  # flat place in the rows
    for p in range(prompts):
        n = int(prompt_lengths[p])
        input_ids[p, :n] = rollout["prompt_ids"][p * group][prompt_mask[p]]
        positions[p, :n], segment[p, :n] = torch.arange(n, device=device), 0
        start = n
        for k in range(group):
            m = int(lengths[p, k])
            input_ids[p, start : start + m] = rollout["completion_ids"][p * group + k, :m]
            positions[p, start : start + m] = torch.arange(n, n + m, device=device)
            segment[p, start : start + m] = k + 1
            # The first token is predicted by the prompt's last position, each later one by the token before it.
            before = torch.cat([torch.tensor([n - 1], device=device), start + torch.arange(m - 1, device=device)])
            predictor[p, k, :m] = p * length + before
            start += m
    query, key = segment[:, :, None], segment[:, None, :]
    causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    mask = causal & (key >= 0) & ((key == 0) | (key == query))
    mask |= torch.eye(length, dtype=torch.bool, device=device)  # a padding row attends to itself: no empty row
    keep = torch.zeros(prompts * length, dtype=torch.bool, device=device)
    keep[predictor.view(-1, width)[completion_mask]] = True
    source = (keep.cumsum(0) - 1)[predictor].view(prompts * group, width) * completion_mask
    return {
        "input_ids": input_ids,
        "position_ids": positions,
        "attention_mask": mask[:, None],
        "keep": keep.view(prompts, length),
        "source": source,
    }

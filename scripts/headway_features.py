"""Read a Headway feature directory (`headway-train prepare`) as the trainer does.

`batches` rebuilds the trainer's first-epoch batch stream exactly: shard and sequence shuffles
from the seed with the same SplitMix64 arithmetic, and the same greedy padded-token packing, so a
PyTorch baseline trains on the very batches `headway-train` does (the benches assert equal token
counts).
"""

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

MASK = (1 << 64) - 1


def mix64(x: int) -> int:
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def shuffled(n: int, seed: int) -> list[int]:
    order = list(range(n))
    state = seed
    for i in range(n - 1, 0, -1):
        state = (state + 0x9E3779B97F4A7C15) & MASK
        j = mix64(state) % (i + 1)
        order[i], order[j] = order[j], order[i]
    return order


def pack(lengths, order, batch_tokens):
    batches, start, longest = [], 0, 0
    for i, s in enumerate(order):
        candidate = max(longest, lengths[s])
        if i > start and (i - start + 1) * candidate > batch_tokens:
            batches.append((start, i))
            start, longest = i, lengths[s]
        else:
            longest = candidate
    if start < len(order):
        batches.append((start, len(order)))
    return batches


def manifest(features: Path) -> dict:
    return json.loads((features / "manifest.json").read_text())


def train_shards(features: Path) -> list[dict]:
    return [s for s in manifest(features)["shards"] if s["split"] == "train"]


def most_frequent_assistant_tokens(features: Path, n: int, vocab: int) -> torch.Tensor:
    """The `n` most frequent assistant tokens of the training split, most frequent first (ties:
    lower id first), as `headway-train --draft-vocab` picks its draft vocabulary."""
    counts = torch.zeros(vocab, dtype=torch.long)
    for shard in train_shards(features):
        data = load_file(features / shard["file"])
        counts += torch.bincount(data["input_ids"][data["loss_mask"].bool()].long(), minlength=vocab)
    return counts.argsort(descending=True, stable=True)[:n]


def batches(features: Path, seed: int, batch_tokens: int):
    """The trainer's epoch-0 stream of dicts: `ids` [B,T] i64, `loss_mask` [B,T] bool, `lengths`
    [B], `hidden` [B,T,H] f32 (the target's final normed hidden state), `taps` [B,T,3H] f32 (the
    stored tap layers, low to high; absent when the features have none) and `tokens` (the batch's
    unpadded tokens)."""
    shards = manifest(features)["shards"]
    taps = manifest(features)["settings"].get("taps") or []
    train = [i for i, s in enumerate(shards) if s["split"] == "train"]
    epoch_seed = seed ^ mix64(0)
    for slot in shuffled(len(train), mix64(epoch_seed)):
        index = train[slot]
        data = load_file(features / shards[index]["file"])
        offsets = data["offsets"].tolist()
        lengths = [b - a for a, b in zip(offsets, offsets[1:])]
        order = shuffled(len(lengths), mix64(seed ^ mix64(0) ^ mix64(index + 1)))
        stacked_taps = torch.cat([data[f"tap_{k}"] for k in taps], -1) if taps else None
        for start, end in pack(lengths, order, batch_tokens):
            members = order[start:end]
            longest = max(lengths[m] for m in members)
            batch = {
                "ids": torch.zeros(len(members), longest, dtype=torch.long),
                "loss_mask": torch.zeros(len(members), longest, dtype=torch.bool),
                "lengths": torch.tensor([lengths[m] for m in members]),
                "hidden": torch.zeros(len(members), longest, data["hidden"].shape[1]),
                "tokens": sum(lengths[m] for m in members),
            }
            if stacked_taps is not None:
                batch["taps"] = torch.zeros(len(members), longest, stacked_taps.shape[1])
            for row, m in enumerate(members):
                a, b = offsets[m], offsets[m + 1]
                batch["ids"][row, : b - a] = data["input_ids"][a:b].long()
                batch["loss_mask"][row, : b - a] = data["loss_mask"][a:b].bool()
                batch["hidden"][row, : b - a] = data["hidden"][a:b].float()
                if stacked_taps is not None:
                    batch["taps"][row, : b - a] = stacked_taps[a:b].float()
            yield batch

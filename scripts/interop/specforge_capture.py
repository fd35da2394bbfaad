"""SpecForge's offline EAGLE-3 capture of Headway's sequences, for `headway-train prepare --from`
(tests/tests/interop.rs).

  write --target DIR --features DIR --out DIR [--dtype float32|bfloat16] [--compress]

For every sequence of a Headway feature directory (its token ids and loss mask, shards in manifest
order), runs the target with transformers and writes the record SpecForge's capture writes: the
eagle3 algorithm's own `OfflineCaptureLayout` over `input_ids`, `loss_mask`, the residual streams
at the manifest's taps side by side (`aux_hidden_states`) and the final post-norm state
(`last_hidden_states`), saved as SpecForge's `scripts/prepare_hidden_states.py` saves a record
(`torch.save`, gzip with `--compress`) at `rows_<a>-<b>/data_<i>.ckpt`. SpecForge's capture itself
runs the target in SGLang on CUDA; transformers computes the same states on this CPU.

Then every file is read back with SpecForge's own offline reader (`OfflineManifestReader`,
`load_feature_file`) and EAGLE-3 normaliser, so the files are proven to be in the layout its
training reads.
"""

import argparse
import gzip
import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from specforge.algorithms.eagle3.data import build_offline_reader, normalize_offline_sample
from specforge.algorithms.eagle3.providers import algorithm_providers
from specforge.runtime.data_plane.feature_store import load_feature_file

# scripts/prepare_hidden_states.py's default --file-group-size.
FILE_GROUP_SIZE = 2000


def headway_sequences(features: Path):
    """(input_ids, loss_mask) of every sequence, shards in manifest order."""
    manifest = json.loads((features / "manifest.json").read_text())
    for shard in manifest["shards"]:
        data = load_file(str(features / shard["file"]))
        offsets = data["offsets"].tolist()
        for a, b in zip(offsets, offsets[1:]):
            yield data["input_ids"][a:b].long(), data["loss_mask"][a:b].long()


def output_file(out: Path, index: int, compress: bool) -> Path:
    start = index // FILE_GROUP_SIZE * FILE_GROUP_SIZE
    folder = out / f"rows_{start}-{start + FILE_GROUP_SIZE}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"data_{index}.ckpt{'.gz' if compress else ''}"


def write(args) -> None:
    taps = json.loads((args.features / "manifest.json").read_text())["settings"]["taps"]
    model = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    layout = algorithm_providers().offline[0].capture_layout
    dtype = getattr(torch, args.dtype)
    count = 0
    for index, (input_ids, loss_mask) in enumerate(headway_sequences(args.features)):
        with torch.no_grad():
            output = model.model(input_ids[None], output_hidden_states=True)
        aux = torch.cat([output.hidden_states[k] for k in taps], dim=-1)[0]
        record = layout.materialize(
            {
                "input_ids": input_ids,
                "loss_mask": loss_mask,
                "aux_hidden_states": aux.to(dtype).clone().unsqueeze(0),
                "last_hidden_states": output.last_hidden_state[0].to(dtype).clone().unsqueeze(0),
            }
        )
        path = output_file(args.out, index, args.compress)
        if args.compress:
            with gzip.open(path, "wb") as f:
                torch.save(record, f)
        else:
            torch.save(record, path)
        count += 1
    print(f"wrote {count} SpecForge capture files ({args.dtype}, taps {taps}) to {args.out}")
    check_with_specforge(args.out, count, len(taps), model.config.hidden_size)


def check_with_specforge(out: Path, count: int, taps: int, hidden: int) -> None:
    refs = build_offline_reader(str(out), run_id="check", ttt_length=7, max_len=4096).read()
    assert len(refs) == count, f"SpecForge's reader lists {len(refs)} files, {count} written"
    for ref in refs:
        sample = normalize_offline_sample(load_feature_file(ref.feature_store_uri.removeprefix("file://")), 4096)
        length = sample["input_ids"].shape[1]
        assert sample["hidden_state"].shape == (1, length, taps * hidden), sample["hidden_state"].shape
        assert sample["target"].shape == (1, length, hidden), sample["target"].shape
        assert sample["loss_mask"].shape == (1, length)
    print(f"SpecForge's offline reader and EAGLE-3 normaliser read all {len(refs)} files")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    writer = commands.add_parser("write", help="capture Headway's sequences in SpecForge's layout")
    writer.add_argument("--target", type=Path, required=True)
    writer.add_argument("--features", type=Path, required=True)
    writer.add_argument("--out", type=Path, required=True)
    writer.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    writer.add_argument("--compress", action="store_true")
    args = parser.parse_args()
    write(args)


if __name__ == "__main__":
    main()

"""Medusa heads between Headway and the Medusa repository (PyPI `medusa-llm`), checked with its
own code: `MedusaConfig` from the export's `config.json`, `MedusaModel` built over the target as
`MedusaModel.from_pretrained` builds it (its base model loaded by its `KVLlamaForCausalLM`), and
`medusa_lm_head.pt` loaded with `torch.load`. Its loader passes `strict=False`, which would hide
misnamed tensors, so the check also requires the file's names to be exactly the heads' own.

The cases file (written by Headway's interop test) holds the target's final hidden states
`hidden` [1, T, H]; for `check-export` also Headway's logits per head `logits_k` [1, T, V].

  check-export --export DIR --target DIR --cases FILE
  write-head --export-config DIR --target DIR --cases FILE --out DIR
                                     heads as MedusaModel initialises them (the target's LM head),
                                     trained briefly, saved as its training script saves them,
                                     and their logits on the cases in OUT/reference_logits.safetensors
"""

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from medusa.model.medusa_model import MedusaConfig, MedusaModel
from medusa.model.modeling_llama_kv import LlamaForCausalLM as KVLlamaForCausalLM


def build(config_dir, target):
    """`MedusaModel.from_pretrained` without its download: the base model from `target`."""
    config = MedusaConfig.from_pretrained(config_dir)
    base = KVLlamaForCausalLM.from_pretrained(target, torch_dtype=torch.float32)
    model = MedusaModel(base, config.medusa_num_heads, config.medusa_num_layers, target)
    return model.float().eval()


def head_logits(model, hidden):
    with torch.no_grad():
        return [head(hidden) for head in model.medusa_head]


def check_export(args) -> int:
    model = build(args.export, args.target)
    state = torch.load(Path(args.export) / "medusa_lm_head.pt", map_location="cpu")
    expected = set(model.medusa_head.state_dict())
    if set(state) != expected:
        print(f"names differ: file {sorted(set(state) - expected)}, heads {sorted(expected - set(state))}",
              file=sys.stderr)
        return 1
    model.medusa_head.load_state_dict(state, strict=False)
    cases = load_file(args.cases)
    worst = 0.0
    for k, logits in enumerate(head_logits(model, cases["hidden"])):
        diff = (logits - cases[f"logits_{k}"]).abs().max().item()
        print(f"head {k}: max |Δlogit| {diff:.2e}")
        worst = max(worst, diff)
    print(f"Medusa repository MedusaModel ({len(model.medusa_head)} heads) on Headway's export: worst |Δ| {worst:.2e}")
    return 0 if worst <= args.tolerance else 1


def write_head(args) -> int:
    torch.manual_seed(args.seed)
    model = build(args.export_config, args.target)
    cases = load_file(args.cases)
    hidden = cases["hidden"]
    optimizer = torch.optim.AdamW(model.medusa_head.parameters(), lr=1e-3)
    labels = torch.randint(0, model.vocab_size, (hidden.shape[1],))
    model.medusa_head.train()
    for _ in range(args.steps):
        optimizer.zero_grad()
        loss = sum(torch.nn.functional.cross_entropy(head(hidden)[0], labels) for head in model.medusa_head)
        loss.backward()
        optimizer.step()
    model.medusa_head.eval()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(model.medusa_head.state_dict(), out / "medusa_lm_head.pt")
    config = json.loads((Path(args.export_config) / "config.json").read_text())
    settings = {key: config[key] for key in ("medusa_num_heads", "medusa_num_layers", "base_model_name_or_path")}
    (out / "config.json").write_text(json.dumps(settings, indent=2) + "\n")
    logits = {f"logits_{k}": l.contiguous() for k, l in enumerate(head_logits(model, hidden))}
    save_file(logits, str(out / "reference_logits.safetensors"))
    print(f"Medusa repository heads trained {args.steps} steps, last loss {loss.item():.3f}, saved to {out}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("check-export")
    check.add_argument("--export", required=True)
    check.add_argument("--target", required=True)
    check.add_argument("--cases", required=True)
    check.add_argument("--tolerance", type=float, default=1e-4)
    write = commands.add_parser("write-head")
    write.add_argument("--export-config", required=True, help="a directory whose config.json gives the head count and layers")
    write.add_argument("--target", required=True)
    write.add_argument("--cases", required=True)
    write.add_argument("--out", required=True)
    write.add_argument("--steps", type=int, default=5)
    write.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    return check_export(args) if args.command == "check-export" else write_head(args)


if __name__ == "__main__":
    sys.exit(main())

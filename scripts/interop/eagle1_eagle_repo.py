"""EAGLE-1 heads between Headway and the EAGLE repository (PyPI `eagle-llm`), checked with its
own model code (`eagle.model.cnets.Model`, built and loaded as `eagle.model.ea_model.EaModel`
does: `EConfig` from `config.json`, `fc` bias from its `"bias"` key, `pytorch_model.bin` loaded
strictly).

The cases file (written by Headway's interop test) holds the target's embedding `embed`, the
target's final hidden states `hidden` [1, T, H] and the next tokens `ids` [1, T]; for
`check-export` also Headway's head outputs `outputs` [1, T, H] (the features its LM head reads).

  check-export --export DIR --cases FILE   load Headway's export, compare the outputs (exit 1 when
                                           any |Δ| exceeds --tolerance)
  write-head --target DIR --cases FILE --out DIR
                                           initialise a head as the EAGLE repository does, train it
                                           briefly, save it as its published heads are
                                           (`pytorch_model.bin` with the embedding, fc with a bias)
                                           and write its outputs to OUT/reference_outputs.safetensors
"""

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eagle.model.cnets import Model
from eagle.model.configs import EConfig


def build(config_dir):
    """The head as `EaModel.__init__` builds it."""
    config = EConfig.from_pretrained(config_dir)
    settings = json.loads((Path(config_dir) / "config.json").read_text())
    return Model(config, bias=settings.get("bias", True)).float()


def check_export(args) -> int:
    model = build(args.export)
    state = torch.load(Path(args.export) / "pytorch_model.bin", map_location="cpu")
    model.load_state_dict(state, strict=True)
    model.eval()
    cases = load_file(args.cases)
    if not torch.equal(model.embed_tokens.weight, cases["embed"]):
        print("the exported embedding is not the target's", file=sys.stderr)
        return 1
    with torch.no_grad():
        outputs = model(cases["hidden"], input_ids=cases["ids"].long())
    worst = (outputs - cases["outputs"]).abs().max().item()
    print(f"EAGLE repository Model on Headway's export: max |Δ| {worst:.2e}")
    return 0 if worst <= args.tolerance else 1


def write_head(args) -> int:
    cases = load_file(args.cases)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = json.loads((Path(args.target) / "config.json").read_text())
    settings.update(num_hidden_layers=1, bias=True)
    (out / "config.json").write_text(json.dumps(settings, indent=2) + "\n")
    torch.manual_seed(args.seed)
    model = build(out)
    model.embed_tokens.weight.data.copy_(cases["embed"])
    # Brief training: regression onto random features, as a first few steps would be.
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    goal = torch.randn_like(cases["hidden"])
    model.train()
    model.gradient_checkpointing = False
    for _ in range(args.steps):
        optimizer.zero_grad()
        loss = torch.nn.functional.smooth_l1_loss(
            model(cases["hidden"], input_ids=cases["ids"].long()), goal
        )
        loss.backward()
        optimizer.step()
    model.eval()
    torch.save(model.state_dict(), out / "pytorch_model.bin")
    with torch.no_grad():
        outputs = model(cases["hidden"], input_ids=cases["ids"].long())
    save_file({"outputs": outputs.contiguous()}, str(out / "reference_outputs.safetensors"))
    print(f"EAGLE repository head trained {args.steps} steps, last loss {loss.item():.3f}, saved to {out}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("check-export")
    check.add_argument("--export", required=True)
    check.add_argument("--cases", required=True)
    check.add_argument("--tolerance", type=float, default=1e-4)
    write = commands.add_parser("write-head")
    write.add_argument("--target", required=True)
    write.add_argument("--cases", required=True)
    write.add_argument("--out", required=True)
    write.add_argument("--steps", type=int, default=5)
    write.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    return check_export(args) if args.command == "check-export" else write_head(args)


if __name__ == "__main__":
    sys.exit(main())

"""EAGLE-3 heads between Headway and SpecForge, checked with SpecForge's own draft model class
(`specforge.modeling.draft.llama3_eagle.LlamaForCausalLMEagle3`).

The cases file (written by Headway's interop test) holds the target's embedding `embed`, the
fused layers' hidden states `taps` [1, T, 3H] and, per round r of training-time test, the next
tokens `ids_r` [1, T]; for `check-export` also Headway's draft logits `logits_r` [1, T, Vd].

  check-export --export DIR --cases FILE   load Headway's export, compare the logits (exit 1 when
                                           any |Δ| exceeds --tolerance)
  write-head --target DIR --cases FILE --out DIR
                                           initialise a head as SpecForge does, train it briefly
                                           (TTT over the cases), save it as SpecForge's export
                                           does, and write its logits on the cases to
                                           OUT/reference_logits.safetensors
"""

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from specforge.modeling.draft.llama3_eagle import (
    LlamaForCausalLMEagle3,
    prepare_decoder_attention_mask,
)


def round_logits(model, cases):
    """The head's logits per round: round 0 reads `fc(taps)`, round r the layer's own output of
    round r − 1 with `ids_r`, SpecForge's training-time test (positions shift by r inside)."""
    rounds = sum(1 for name in cases if name.startswith("ids_"))
    hidden = model.project_hidden_states(cases["taps"])
    length = hidden.shape[1]
    mask = prepare_decoder_attention_mask(
        torch.ones((1, length), dtype=torch.bool), (1, length), hidden, 0
    )
    positions = torch.arange(length).unsqueeze(0)
    cache = [[], []]
    logits = []
    for r in range(rounds):
        embeds = model.embed_input_ids(cases[f"ids_{r}"].long())
        hidden = model.backbone(embeds, hidden, cache, mask, positions)
        logits.append(model.compute_logits(hidden))
    return logits


def check_export(args) -> int:
    config = LlamaConfig.from_pretrained(args.export)
    model = LlamaForCausalLMEagle3(config).float().eval()
    state = load_file(f"{args.export}/model.safetensors")
    missing, unexpected = model.load_state_dict(state, strict=False)
    # The embedding is the target's and not exported (SpecForge's own export drops it too).
    if set(missing) != {"embed_tokens.weight"} or unexpected:
        print(f"missing {missing}, unexpected {unexpected}", file=sys.stderr)
        return 1
    cases = load_file(args.cases)
    model.embed_tokens.weight.data.copy_(cases["embed"])
    worst = 0.0
    with torch.no_grad():
        for r, logits in enumerate(round_logits(model, cases)):
            diff = (logits - cases[f"logits_{r}"]).abs().max().item()
            print(f"round {r}: max |Δlogit| {diff:.2e}")
            worst = max(worst, diff)
    # Draft token i is target token i + d2t[i]; t2d marks exactly those.
    targets = torch.arange(model.d2t.shape[0]) + model.d2t
    if not bool(model.t2d[targets].all()) or int(model.t2d.sum()) != targets.shape[0]:
        print("d2t and t2d disagree", file=sys.stderr)
        return 1
    print(f"SpecForge {type(model).__name__} on Headway's export: worst |Δ| {worst:.2e}")
    return 0 if worst <= args.tolerance else 1


def write_head(args) -> int:
    cases = load_file(args.cases)
    config = LlamaConfig.from_pretrained(args.target)
    config.architectures = ["LlamaForCausalLMEagle3"]
    config.num_hidden_layers = 1
    config.draft_vocab_size = args.draft_vocab
    config.tie_word_embeddings = False
    torch.manual_seed(args.seed)
    model = LlamaForCausalLMEagle3(config).float()
    model.embed_tokens.weight.data.copy_(cases["embed"])
    model.embed_tokens.weight.requires_grad_(False)
    # A draft vocabulary that is not a prefix of the target's: every other id from the top.
    draft_ids = torch.arange(config.vocab_size - 1, -1, -2)[: args.draft_vocab].sort().values
    model.d2t.copy_(draft_ids - torch.arange(args.draft_vocab))
    model.t2d.zero_()
    model.t2d[draft_ids] = True
    # Brief training: TTT rounds against random draft tokens, Adam, as a user's first steps.
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=1e-3
    )
    labels = torch.randint(0, args.draft_vocab, (len(round_logits(model, cases)), 1, cases["taps"].shape[1]))
    for _ in range(args.steps):
        optimizer.zero_grad()
        loss = sum(
            torch.nn.functional.cross_entropy(logits[0], labels[r][0])
            for r, logits in enumerate(round_logits(model, cases))
        )
        loss.backward()
        optimizer.step()
    model.eval()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "embed_tokens.weight"}
    save_file(state, str(out / "model.safetensors"))
    config_dict = config.to_dict()
    (out / "config.json").write_text(json.dumps(config_dict, indent=2) + "\n")
    with torch.no_grad():
        logits = {f"logits_{r}": l.contiguous() for r, l in enumerate(round_logits(model, cases))}
    save_file(logits, str(out / "reference_logits.safetensors"))
    print(f"SpecForge head trained {args.steps} steps, last loss {loss.item():.3f}, saved to {out}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("check-export")
    check.add_argument("--export", required=True)
    check.add_argument("--cases", required=True)
    check.add_argument("--tolerance", type=float, default=1e-4)
    write = commands.add_parser("write-head")
    write.add_argument("--target", required=True)
    write.add_argument("--cases", required=True)
    write.add_argument("--out", required=True)
    write.add_argument("--draft-vocab", type=int, default=100)
    write.add_argument("--steps", type=int, default=5)
    write.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    return check_export(args) if args.command == "check-export" else write_head(args)


if __name__ == "__main__":
    sys.exit(main())

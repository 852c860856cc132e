"""`omni-core models list | make FAMILY SIZE DIR`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from omni_core.models.catalog import FAMILIES, ModelSpecError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="models_command", required=True)
    sub.add_parser("list", help="the families and sizes that `make` writes")
    p = sub.add_parser("make", help="write a local checkpoint with seeded random weights")
    p.add_argument("family", help=f"one of {', '.join(FAMILIES)}")
    p.add_argument("size", help="tiny (seconds on CPU, a few MB) or a realistic size; see `models list`")
    p.add_argument("dir", help="target directory (created; must be empty unless --force)")
    p.add_argument("--seed", type=int, default=0, help="weights are a function of the seed (default 0)")
    p.add_argument("--dtype", default=None, help="float32, float16 or bfloat16 (default: the size's)")
    p.add_argument("--force", action="store_true", help="write into a non-empty directory, replacing same names")
    p.add_argument("--quiet", action="store_true", help="no progress line (it is shown only on a terminal anyway)")
    p.add_argument(
        "--lora",
        action="store_true",
        help="also write a small seeded LoRA adapter into DIR/lora: PEFT's format, rank 4 on q_proj,v_proj "
        "(a transformers model); diffusers' format on to_q,to_v of the transformer or UNet (dit, sd)",
    )
    for p in sub.choices.values():
        p.add_argument("--json", action="store_true", help="print the result as JSON")


def run(args: argparse.Namespace) -> int:
    if args.models_command == "list":
        if args.json:
            sizes = {
                f.name: [{"size": s.name, "params": s.nominal_params, "dtype": s.dtype} for s in f.sizes.values()]
                for f in FAMILIES.values()
            }
            print(
                json.dumps(
                    [
                        {"family": f.name, "description": f.description, "sizes": sizes[f.name]}
                        for f in FAMILIES.values()
                    ],
                    indent=2,
                )
            )
            return 0
        for family in FAMILIES.values():
            print(f"{family.name:6} {family.description}")
            for size in family.sizes.values():
                print(f"       {size.name:5} {size.nominal_params / 1e6:10.2f}M params, {size.dtype}")
        return 0
    from omni_core.models.make import make_checkpoint
    from omni_core.progress import Progress

    progress = Progress(f"{args.family} {args.size}", unit="M params", scale=1e6, enabled=False if args.quiet else None)
    try:
        with progress:
            info = make_checkpoint(
                args.family, args.size, args.dir, seed=args.seed, dtype=args.dtype, force=args.force, progress=progress
            )
    except ModelSpecError as exc:
        print(f"omni-core models make: error: {exc}", file=sys.stderr)
        return 2
    result: dict[str, object] = dataclasses.asdict(info)
    lines = [info.summary()]
    if args.lora:
        from omni_core.models.lora import make_diffusers_lora, make_lora

        make = make_diffusers_lora if args.family in ("dit", "sd") else make_lora  # the pipelines' own format
        try:
            lora = make(info.path, f"{info.path}/lora", seed=args.seed)
        except ModelSpecError as exc:
            print(f"omni-core models make --lora: error: {exc}", file=sys.stderr)
            return 2
        result["lora"] = dataclasses.asdict(lora)
        lines.append(lora.summary())
    print(json.dumps(result, indent=2) if args.json else "\n".join(lines))
    return 0

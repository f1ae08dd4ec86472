"""The ``gshard-jax`` command line.

Subcommands:
  params   total and per-token active parameters of a config's model (shapes only, nothing allocated)
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence


def _params(args: argparse.Namespace) -> int:
    from . import configs
    cfg = configs.load(args.config)
    counts = configs.count_params(cfg.model)
    if args.json:
        print(json.dumps(counts))
    else:
        total, active = counts["total_params"], counts["active_params"]
        print(f"{args.config}: {total:,} parameters ({total / 1e9:.2f}B), {active:,} active per token "
              f"({active / 1e9:.2f}B)")
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gshard-jax", description="GShard-style MoE Transformers on JAX: "
                                "experiments from ml-collections configs in experiments/.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    q = sub.add_parser("params", help="count a config's parameters (total and active per token)",
                       description="Print the total parameters and the parameters active per token of the "
                       "config's model, computed from shapes with jax.eval_shape (nothing is allocated).")
    q.add_argument("--config", required=True, help="experiment file, e.g. experiments/mula_7b_a1b.py")
    q.add_argument("--json", action="store_true", help='print one JSON object {"total_params": N, '
                   '"active_params": N}')
    q.set_defaults(run=_params)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"gshard-jax {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

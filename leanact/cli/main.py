"""`leanact` console script."""
from __future__ import annotations

import argparse
import json
import sys

from .profile import DTYPES, ProfileConfig, render, run_profile


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _probability(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text!r}") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"dropout must be in [0, 1), got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="leanact", description="Activation memory for Transformer training.")
    sub = parser.add_subparsers(dest="command", required=True)
    d = ProfileConfig()
    p = sub.add_parser("profile", help="compare what a BERT-style layer keeps for backward: torch.nn vs leanact",
                       description="Builds a BERT-style encoder layer on the CPU from torch.nn modules and from "
                                   "leanact's drop-ins (same weights) and prints bytes kept per autograd op, B/sbh "
                                   "and the forward+backward time ratio, measured side by side.")
    p.add_argument("--hidden", type=_positive, default=d.hidden, help=f"hidden size h (default {d.hidden})")
    p.add_argument("--heads", type=_positive, default=d.heads, help=f"attention heads a (default {d.heads})")
    p.add_argument("--seq", type=_positive, default=d.seq, help=f"sequence length s (default {d.seq})")
    p.add_argument("--batch", type=_positive, default=d.batch, help=f"micro-batch b (default {d.batch})")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=d.dtype, help=f"default {d.dtype}")
    p.add_argument("--dropout", type=_probability, default=d.dropout, help=f"default {d.dropout}")
    p.add_argument("--repeats", type=_positive, default=d.repeats, help=f"timed steps per mode (default {d.repeats})")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON instead of a table")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "profile":
        if args.hidden % args.heads:
            parser.error(f"--hidden {args.hidden} must be a multiple of --heads {args.heads}")
        cfg = ProfileConfig(hidden=args.hidden, heads=args.heads, seq=args.seq, batch=args.batch,
                            dtype=args.dtype, dropout=args.dropout, repeats=args.repeats)
        if args.json:
            print(json.dumps(run_profile(cfg).to_dict(), indent=2))
            return 0
        from rich.console import Console
        from rich.progress import Progress

        console = Console()
        with Progress(console=console, transient=True) as bar:
            task = bar.add_task("timing forward+backward", total=2 * cfg.repeats)
            result = run_profile(cfg, progress=lambda n: bar.advance(task, n))
        console.print(render(result))
        return 0
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())

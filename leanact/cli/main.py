"""`leanact` console script: `leanact profile` (Hugging Face models) and `leanact layers` (one layer)."""
from __future__ import annotations

import argparse
import io
import json
import os
import sys

from . import layers as layer_cmd
from . import profile as profile_cmd
from .output import busy_warning, quiet_transformers
from .sizes import parse_size


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def _probability(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text!r}") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"dropout must be in [0, 1), got {value}")
    return value


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _png(text: str) -> str:
    if not text.lower().endswith(".png"):
        raise argparse.ArgumentTypeError(f"--plot writes a PNG file: give a name ending in .png, got {text!r}")
    return text


def _add_profile(sub) -> None:
    from leanact.models.geometries import GEOMETRIES

    p = sub.add_parser(
        "profile", help="activation memory and step time of a Hugging Face model: unpatched vs leanact",
        description="Builds a Hugging Face model from its config (random weights, CPU) in four modes -- HF eager, "
                    "HF sdpa, leanact.patch(attention='recompute') and leanact.patch(attention='tempo') -- and "
                    "prints what one layer keeps for backward (2-layer minus 1-layer model), B/sbh, the whole "
                    "model's activation memory at the chosen batch (measured at batch 1 and 2, affine in the batch) "
                    "and the forward+backward time of the 1-layer model, modes interleaved in one run (medians).")
    p.add_argument("--model", default=profile_cmd.DEFAULT_MODEL,
                   help=f"{', '.join(GEOMETRIES)}, or a path to a Hugging Face config.json "
                        f"(default {profile_cmd.DEFAULT_MODEL})")
    p.add_argument("--seq", type=_positive, help="sequence length s (default: per model, 128 for bert-base)")
    p.add_argument("--batch", type=_positive, help="batch for the activation column and the timing "
                                                   "(default: per model, 2 for bert-base)")
    p.add_argument("--dtype", choices=list(profile_cmd.DTYPES), default=None,
                   help="weights and inputs (default bf16 where the CPU multiplies bf16 natively, AVX512-BF16 "
                        "or AMX, else fp32; fp32 with --autocast)")
    p.add_argument("--autocast", choices=list(profile_cmd.AUTOCAST), default=None,
                   help="fp32 weights, every forward under torch.autocast of this dtype (mixed precision)")
    p.add_argument("--dropout", type=_probability, help="set every dropout probability of the config "
                                                        "(default: the config's own)")
    p.add_argument("--repeats", type=_non_negative,
                   help="timed steps per mode, 0 to skip timing (default: per model, 4 for bert-base)")
    p.add_argument("--budget", type=_size, help="activation memory budget, e.g. 16GiB, 512MiB, 10GB, 1e9: "
                                                "adds the largest batch that fits, per mode, and leanact.plan's "
                                                "plan for the unpatched model")
    p.add_argument("--context-parallel", type=_positive, metavar="P",
                   help="with --budget: the longest sequence shared by P GPUs (leanact.parallel.context_parallel; "
                        "the budget per GPU)")
    p.add_argument("--plot", type=_png, metavar="FILE.png", help="write a bar chart of the per-op breakdown")
    p.add_argument("--ops", action="store_true", help="also print the per-layer breakdown by autograd op")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON instead of tables")
    p.set_defaults(subparser=p)


def _add_layers(sub) -> None:
    d = layer_cmd.ProfileConfig()
    p = sub.add_parser("layers", help="one BERT-style encoder layer: torch.nn modules vs leanact drop-ins",
                       description="Builds a BERT-style encoder layer on the CPU from torch.nn modules and from "
                                   "leanact's drop-ins (same weights) and prints bytes kept per autograd op, B/sbh "
                                   "and the forward+backward time ratio, measured side by side.")
    p.add_argument("--hidden", type=_positive, default=d.hidden, help=f"hidden size h (default {d.hidden})")
    p.add_argument("--heads", type=_positive, default=d.heads, help=f"attention heads a (default {d.heads})")
    p.add_argument("--seq", type=_positive, default=d.seq, help=f"sequence length s (default {d.seq})")
    p.add_argument("--batch", type=_positive, default=d.batch, help=f"micro-batch b (default {d.batch})")
    p.add_argument("--dtype", choices=sorted(layer_cmd.DTYPES), default=None,
                   help="default bf16 where the CPU multiplies bf16 natively (AVX512-BF16 or AMX), else fp32")
    p.add_argument("--dropout", type=_probability, default=d.dropout, help=f"default {d.dropout}")
    p.add_argument("--repeats", type=_non_negative, default=d.repeats,
                   help=f"timed steps per mode, 0 to skip timing (default {d.repeats})")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON instead of a table")
    p.set_defaults(subparser=p)


def build_parser() -> argparse.ArgumentParser:
    from leanact._version import __version__

    parser = argparse.ArgumentParser(prog="leanact", description="Activation memory for Transformer training.")
    parser.add_argument("--version", action="version", version=f"leanact {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_profile(sub)
    _add_layers(sub)
    return parser


def _check_plot(parser: argparse.ArgumentParser, path: str) -> None:
    """Exit 2 before any work when ``--plot`` cannot write ``path`` (no matplotlib, no such folder, no
    permission)."""
    from .plot import missing_matplotlib

    why = missing_matplotlib()
    folder = os.path.dirname(os.path.abspath(path))
    if why is None and not os.path.isdir(folder):
        why = f"cannot write --plot {path!r}: folder {folder!r} does not exist"
    elif why is None and (os.path.isdir(path) or not os.access(path if os.path.exists(path) else folder, os.W_OK)):
        why = f"cannot write --plot {path!r}: {'it is a folder' if os.path.isdir(path) else 'permission denied'}"
    if why is not None:
        parser.error(why)


def _write_plot(result, path: str) -> int | None:
    """Write the plot; on an OSError say why on stderr and return the exit status 2."""
    from .plot import plot

    try:
        plot(result, path)
    except OSError as e:
        print(f"leanact profile: error: cannot write --plot {path!r}: {e}", file=sys.stderr)
        return 2
    return None


def _warn_if_busy(repeats: int) -> None:
    warning = busy_warning() if repeats else None
    if warning is not None:
        print(warning, file=sys.stderr)


def _profile_vlm(parser: argparse.ArgumentParser, args, geo) -> int:
    """A vision-language config: the whole step predicted (leanact.cli.vlm_profile)."""
    from leanact.cli.vlm_profile import render_vlm, run_vlm_profile

    unsupported = [flag for flag, value in (("--budget", args.budget), ("--autocast", args.autocast),
                                            ("--plot", args.plot), ("--ops", args.ops), ("--batch", args.batch),
                                            ("--context-parallel", args.context_parallel),
                                            ("--dropout", args.dropout), ("--repeats", args.repeats))
                   if value not in (None, False)]
    if unsupported:
        raise ValueError(f"{geo.name} is a vision-language model: leanact profile predicts its whole step for one "
                         f"image and --seq text tokens; {', '.join(unsupported)} are for text and image models")
    result = run_vlm_profile(geo, args.seq or geo.seq, args.dtype or "bf16")
    print(json.dumps(result, indent=2) if args.json else render_vlm(result))
    return 0


def _profile(parser: argparse.ArgumentParser, args) -> int:
    from leanact.models.geometries import resolve

    try:
        geo = resolve(args.model)
        if geo.vlm:
            return _profile_vlm(parser, args, geo)
        dtype = args.dtype or ("fp32" if args.autocast else profile_cmd.default_dtype())
        cfg = profile_cmd.ProfileConfig(args.model, args.seq, args.batch, dtype, args.dropout, args.repeats,
                                        args.budget, autocast=args.autocast,
                                        context_parallel=args.context_parallel).resolved(geo)
        if args.context_parallel and not args.budget:
            raise ValueError("--context-parallel goes with --budget (the longest sequence over P GPUs)")
        geo.check_seq(cfg.seq)
    except ValueError as e:
        parser.error(str(e))
    if args.plot:
        _check_plot(parser, args.plot)
    if args.dtype is None and not args.autocast and cfg.dtype == "fp32":
        print(profile_cmd.FP32_NOTE, file=sys.stderr)
    _warn_if_busy(cfg.repeats)
    if args.json:
        result = profile_cmd.run_profile(cfg)
        if cfg.budget is not None:
            try:
                result.plan = _plan_text(cfg)
            except Exception as e:
                return _planner_failed(e)
            result.longest = profile_cmd.longest_sequence(cfg)
        if args.plot and (failed := _write_plot(result, args.plot)):
            return failed
        print(json.dumps(result.to_dict(), indent=2))
        return 0
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console()
    with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), console=console,
                  transient=True) as bar:
        task = bar.add_task(f"building {geo.name}", total=profile_cmd.steps_total(cfg))
        result = profile_cmd.run_profile(cfg, progress=lambda n, what: bar.update(task, advance=n, description=what))
    console.print(profile_cmd.render(result))
    if (left := profile_cmd.render_summary(result)) is not None:
        console.print(left)
    if args.ops:
        console.print(profile_cmd.render_ops(result))
    if args.plot:
        if failed := _write_plot(result, args.plot):
            return failed
        console.print(f"wrote {args.plot}")
    if cfg.budget is not None:
        try:
            explained, note = profile_cmd.planner_explanation(cfg)
        except Exception as e:
            return _planner_failed(e)
        console.print(note)
        if explained is not None:
            console.print(explained)
        if (longest := profile_cmd.longest_sequence(cfg)) is not None:
            console.print(profile_cmd.longest_text(longest, cfg))
    return 0


def _planner_failed(e: Exception) -> int:
    """Report a failure of leanact.plan under --budget on stderr; the exit status (1)."""
    print(f"leanact profile: error: planner failed: {type(e).__name__}: {e}", file=sys.stderr)
    return 1


def _plan_text(cfg) -> str:
    """The planner's explanation as plain text (or the note saying why there is none), for --json."""
    from rich.console import Console

    explained, note = profile_cmd.planner_explanation(cfg)
    if explained is None:
        return note
    console = Console(record=True, width=80, file=io.StringIO())
    console.print(explained)
    return console.export_text()


def _layers(parser: argparse.ArgumentParser, args) -> int:
    if args.hidden % args.heads:
        parser.error(f"--hidden {args.hidden} must be a multiple of --heads {args.heads}")
    cfg = layer_cmd.ProfileConfig(hidden=args.hidden, heads=args.heads, seq=args.seq, batch=args.batch,
                                  dtype=args.dtype or profile_cmd.default_dtype(), dropout=args.dropout,
                                  repeats=args.repeats)
    if args.dtype is None and cfg.dtype == "fp32":
        print(profile_cmd.FP32_NOTE.replace("leanact profile", "leanact layers"), file=sys.stderr)
    _warn_if_busy(cfg.repeats)
    if args.json:
        print(json.dumps(layer_cmd.run_profile(cfg).to_dict(), indent=2))
        return 0
    from rich.console import Console
    from rich.progress import Progress

    console = Console()
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("timing forward+backward", total=2 * cfg.repeats)
        result = layer_cmd.run_profile(cfg, progress=lambda n: bar.advance(task, n))
    console.print(layer_cmd.render(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    with quiet_transformers():
        if args.command == "profile":
            return _profile(args.subparser, args)
        if args.command == "layers":
            return _layers(args.subparser, args)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())

"""`python -m bridge compare ...`: jaxmoe vs the PyTorch reference (and Megatron's recordings)."""

from __future__ import annotations

import argparse
import json
import sys

from bridge import compare, megatron
from bridge.errors import BridgeError
from bridge.safe_load import load_torch_file


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bridge")
    commands = parser.add_subparsers(dest="command", required=True)
    cmp = commands.add_parser(
        "compare",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        help="compare jaxmoe with the PyTorch reference stage by stage",
        description="Build jaxmoe and the PyTorch reference from one Megatron checkpoint layer, "
        "feed both the same input (io.pt's x, else seeded random), and report per "
        "stage the bitwise-equal fraction, max abs difference and max ULP distance. "
        "Exit status 0 when every stage is within its bound, 1 otherwise.",
        epilog=compare.bounds_help(),
    )
    cmp.add_argument(
        "--megatron",
        required=True,
        metavar="CKPT",
        help="torch_dist directory, legacy file, or legacy checkpoint tree",
    )
    cmp.add_argument("--layer", required=True, type=int, help="global index of an MoE layer")
    cmp.add_argument(
        "--io", metavar="IO_PT", help="Megatron recordings (x, dy, y, dx, param_grads, routing_map)"
    )
    cmp.add_argument("--json", metavar="OUT", help="also write the report as JSON here")
    cmp.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    cmp.add_argument(
        "--config",
        metavar="CONFIG_JSON",
        help="Megatron config (needed when the checkpoint saved no args)",
    )
    cmp.add_argument("--seed", type=int, default=0, help="seed of the random x and dy")
    cmp.add_argument(
        "--shape",
        type=int,
        nargs=2,
        metavar=("B", "S"),
        help="batch and sequence length of the random x (default "
        f"{compare.INPUT_SHAPE[0]} {compare.INPUT_SHAPE[1]}; not with --io)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 pass, 1 a bound violated, 2 error)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.shape and args.io:
        parser.error("--shape sets the random input; with --io the input is io.pt's x")
    if args.shape and min(args.shape) < 1:
        parser.error(f"--shape needs B, S >= 1, got {args.shape[0]} {args.shape[1]}")
    try:
        ckpt = megatron.load(args.megatron, args.config)
        io = load_torch_file(args.io) if args.io else None
        report = compare.compare_layer(
            ckpt,
            args.layer,
            io=io,
            device=args.device,
            seed=args.seed,
            input_shape=tuple(args.shape or compare.INPUT_SHAPE),
        )
    except BridgeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(compare.format_table(report))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=1)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

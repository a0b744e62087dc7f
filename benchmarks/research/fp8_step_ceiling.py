"""How fast the FP8-blockwise training step could be next to bf16's, from a layer benchmark's
profile: an Amdahl bound, computed (no GPU needed) from the files `benchmarks/layer.py` wrote.

    python -m benchmarks.research.fp8_step_ceiling LAYER_JSON [LAYER_JSON ...]
        [--fwd-target 1.7] [--dgrad-target 1.7] [--wgrad-target 1.45] [--tag TAG] [--out DIR]

Each LAYER_JSON must hold train-mode stage records of jaxmoe_bf16, jaxmoe_fp8_blockwise and
jaxmoe_fp8_blockwise_cached_weights, with its `_kernels.json` beside it (one profiled step's
attributed kernels). Per shape, in device ms a step (each variant's kernels scaled to its mean
device time over the profiled steps):

  split      the experts' GEMMs by pass (fc1 and fc2: fprop = the grouped GEMMs of the forward,
             dgrad = those of the backward, wgrad = the weight-gradient kernels), the weights'
             128 x 128 quantize (kernels named quantize_128x128*), and the rest of the step
             (router, dispatch, activation, combine, quantizes of activations and gradients)
  rest       the rest by profile stage and direction (e.g. "activation backward"), and the FP8
             variants' excess over bf16's there, largest first: where the FP8-only passes cost
  measured   bf16 ms / FP8 ms, with and without the cached weight copies
  ceilings   bf16 ms / the FP8 step with its rest at bf16's rest (every FP8-only pass but the
             weights' quantize free): at the measured FP8 GEMMs, and at GEMMs exactly
             `--*-target` times faster than bf16's (the issue's per-op targets), each with
             the weight quantize as measured, at its floor (the bf16 weights read once and
             two e4m3 copies written, at the run's copy bandwidth), at a floor no kernel can
             pass (the bf16 weights read once, nothing written, at the read bandwidth), and
             cached (none)

A ceiling below a target speed-up is the measured reason that no work on the FP8-only passes
reaches it. Writes fp8_step_ceiling_<date>[_tag].json (inputs, splits, ceilings) and prints a
table.
"""

from __future__ import annotations

import argparse
import json
import os

from benchmarks.report import add_output_arguments, result_path, write_result

VARIANTS = {
    "bf16": "jaxmoe_bf16",
    "fp8": "jaxmoe_fp8_blockwise",
    "cached": "jaxmoe_fp8_blockwise_cached_weights",
}
EXPERT_STAGES = ("fc1", "fc2")
WEIGHT_QUANTIZE = "quantize_128x128"
PASSES = ("fprop", "dgrad", "wgrad")


def kernel_pass(row: dict) -> str:
    """A profiled kernel's share of the step: an expert GEMM pass, the weights' quantize or
    the rest."""
    name = row["kernel"]
    if name.startswith(WEIGHT_QUANTIZE):
        return "weight_quantize"
    if row["stage"] in EXPERT_STAGES and row["kind"] == "gemm":
        if name.startswith("tgmm"):
            return "wgrad"
        return "dgrad" if row["backward"] else "fprop"
    return "rest"


def scaled_ms(stage_record: dict, kernels: list[dict]) -> list[tuple[dict, float]]:
    """Each profiled kernel with its ms a step: the profiled step's kernels scaled to the
    variant's mean device time, so that they sum to it."""
    total = sum(row["dur_us"] for row in kernels) / 1e3
    if total <= 0:
        raise ValueError("no kernels in the profiled step")
    scale = stage_record["device_ms"] / total
    return [(row, row["dur_us"] / 1e3 * scale) for row in kernels]


def split(scaled: list[tuple[dict, float]]) -> dict[str, float]:
    """ms a step of each part (`kernel_pass`) of `scaled_ms`'s kernels."""
    parts = dict.fromkeys((*PASSES, "weight_quantize", "rest"), 0.0)
    for row, ms in scaled:
        parts[kernel_pass(row)] += ms
    return parts


def rest_by_stage(scaled: list[tuple[dict, float]]) -> dict[str, float]:
    """ms a step of the rest's kernels by profile stage and direction."""
    stages = {}
    for row, ms in scaled:
        if kernel_pass(row) == "rest":
            key = f"{row['stage']} {'backward' if row['backward'] else 'forward'}"
            stages[key] = stages.get(key, 0.0) + ms
    return stages


def excess_over(base: dict[str, float], other: dict[str, float]) -> dict[str, float]:
    """other - base for every key of either, largest first."""
    keys = set(base) | set(other)
    excess = {k: other.get(k, 0.0) - base.get(k, 0.0) for k in keys}
    return dict(sorted(excess.items(), key=lambda item: -item[1]))


def weight_elements(shape: dict) -> int:
    """Elements of the routed experts' fc1 and fc2 weights."""
    fc1_out = shape["ffn_hidden_size"] * (2 if shape["gated_linear_unit"] else 1)
    return shape["num_experts"] * shape["hidden"] * (fc1_out + shape["ffn_hidden_size"])


def ceilings(parts: dict, shape: dict, bandwidth: dict, targets: dict) -> dict:
    """The bounds of the module docstring for one shape: parts[variant] from `split`."""
    bf16, fp8, cached = parts["bf16"], parts["fp8"], parts["cached"]
    step = {name: sum(p.values()) for name, p in parts.items()}
    elements = weight_elements(shape)
    weight_quantize = {
        "measured": fp8["weight_quantize"],
        "copy_floor": elements * (2 + 1 + 1) / bandwidth["copy"] * 1e3,
        "read_only_floor": elements * 2 / bandwidth["read"] * 1e3,
        "cached": 0.0,
    }
    gemms = {
        "measured": sum(fp8[p] for p in PASSES),
        "targets": sum(bf16[p] / targets[p] for p in PASSES),
    }
    return dict(
        step_ms=step,
        weight_quantize_ms=weight_quantize,
        expert_gemm_ms=dict(gemms, bf16=sum(bf16[p] for p in PASSES)),
        pass_speedup={p: bf16[p] / fp8[p] for p in PASSES},
        measured_speedup={
            "uncached": step["bf16"] / step["fp8"],
            "cached": step["bf16"] / step["cached"],
        },
        fp8_rest_over_bf16_rest={
            "uncached": fp8["rest"] / bf16["rest"],
            "cached": cached["rest"] / bf16["rest"],
        },
        ceiling_speedup={
            gemm: {
                quantize: step["bf16"] / (gemm_ms + quantize_ms + bf16["rest"])
                for quantize, quantize_ms in weight_quantize.items()
            }
            for gemm, gemm_ms in gemms.items()
        },
    )


def analyse(layer_path: str, targets: dict) -> dict:
    """{shape: ceilings} of one layer benchmark file and its kernels file."""
    with open(layer_path) as f:
        layer = json.load(f)
    with open(layer_path.removesuffix(".json") + "_kernels.json") as f:
        kernels = json.load(f)
    out = {}
    for shape_name, shape in layer["shapes"].items():
        records = {
            s["impl"]: s
            for s in layer["stages"]
            if s["shape"] == shape_name and s["mode"] == "train"
        }
        missing = [impl for impl in VARIANTS.values() if impl not in records]
        if missing:
            raise ValueError(f"{layer_path}: {shape_name} has no train stage records of {missing}")
        scaled = {
            name: scaled_ms(records[impl], kernels[f"{shape_name}/train/{impl}"]["kernels"])
            for name, impl in VARIANTS.items()
        }
        parts = {name: split(rows) for name, rows in scaled.items()}
        rest = {name: rest_by_stage(rows) for name, rows in scaled.items()}
        out[shape_name] = dict(
            source=os.path.basename(layer_path),
            device=layer["device"],
            date=layer["date"],
            parts_ms=parts,
            rest_by_stage_ms=rest,
            rest_excess_over_bf16_ms={
                name: excess_over(rest["bf16"], rest[name]) for name in ("fp8", "cached")
            },
            **ceilings(parts, shape, layer["bandwidth_bytes_per_s"], targets),
        )
    return out


def print_table(result: dict) -> None:
    """One line per shape: measured speed-ups, then the ceilings."""
    print(
        f"{'shape':10s} {'measured':>15s} | ceilings (rest at bf16's), weights: "
        "measured / copy floor / read-only floor / cached"
    )
    for name, r in result["shapes"].items():
        m = r["measured_speedup"]
        print(f"{name:10s} {m['uncached']:6.3f} {m['cached']:6.3f}x (cached)")
        for gemm, row in r["ceiling_speedup"].items():
            values = " / ".join(f"{v:.3f}" for v in row.values())
            print(f"{'':10s} GEMMs {gemm:8s} ({r['expert_gemm_ms'][gemm]:7.3f} ms): {values}")
        largest = list(r["rest_excess_over_bf16_ms"]["cached"].items())[:3]
        print(
            f"{'':10s} rest over bf16's (cached): "
            + ", ".join(f"{stage} {ms:+.3f} ms" for stage, ms in largest)
        )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("layers", nargs="+", help="layer benchmark JSON files")
    parser.add_argument("--fwd-target", type=float, default=1.7)
    parser.add_argument("--dgrad-target", type=float, default=1.7)
    parser.add_argument("--wgrad-target", type=float, default=1.45)
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    targets = {"fprop": args.fwd_target, "dgrad": args.dgrad_target, "wgrad": args.wgrad_target}
    shapes = {}
    for path in args.layers:
        shapes.update(analyse(path, targets))
    result = dict(
        benchmark="fp8_step_ceiling",
        method=__doc__.split("\n\n", 2)[2].split("\n\nA ceiling")[0],
        targets=targets,
        shapes=shapes,
    )
    path = result_path(args.out, "fp8_step_ceiling", args.tag)
    write_result(result, path)
    print_table(result)
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()

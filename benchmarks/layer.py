"""MoE layer benchmark on one GPU: jaxmoe's layer next to a PyTorch and a plain-JAX MoE.

    python -m benchmarks.layer [--shapes mixtral,qwen3_30b,dsv3_ep8,deepseek_v3_style]
        [--modes train,inference] [--impls jaxmoe_bf16,...] [--no-competitors] [--no-profile]
        [--iters 1] [--min-window 0.1] [--repeats 3] [--tag TAG] [--out DIR]

For each `jaxmoe.shapes` layer (x [batch, seq_len, H] bf16 and one set of bf16 weights, shared
by every implementation), in one process:
  modes      train: loss = sum(y * dy) + aux loss, gradients w.r.t. x and every parameter (all
             returned, with the loss and the routing counts); inference: the forward alone
  jaxmoe     jaxmoe_bf16 (gmm_impl "auto": Pallas kernels for every matmul on Hopper,
             batch-invariant), jaxmoe_bf16_xla_dense (dense_impl "xla": router and shared
             expert on cuBLAS, not batch-invariant: the difference is the cost of batch
             invariance), jaxmoe_mxfp8 (`LayerShape.with_precision("mxfp8")`) and
             jaxmoe_fp8_blockwise (`with_precision("fp8_blockwise")`: H and F multiples of 128);
             jaxmoe_mxfp8_cached_weights and jaxmoe_fp8_blockwise_cached_weights: the same
             with the experts' fp8 copies made before the step (`MoE.quantize_expert_weights`,
             passed as `expert_weights=`): a micro-batch of an optimizer step that shares
             them, as Transformer Engine caches fp8 weights across micro-batches
  competitors  torch_grouped_mm (`layer_competitors.torch_moe`, autograd), torch_compile (the
             same under torch.compile, default mode, compile time excluded) and jax_ragged_dot
             (`layer_competitors.jax_moe`); bf16. Each is checked against jaxmoe_bf16: relative
             norm errors of the outputs / gradients and the share of tokens routed differently
             (near-tied router logits may pick other experts when the logits' rounding differs).
  ceiling    dense_gemms (`layer_competitors.torch_dense_gemms`): the expert GEMMs' FLOPs alone
             as dense cuBLAS matmuls, unchecked; torch's ms over its ms is the most any layer
             whose GEMMs run at cuBLAS's dense speed can gain over torch_grouped_mm
  floor      the least time of jaxmoe's dispatch, activation and combine as the separate passes
             they are (`unfused_stage_bytes` over the higher of the copy and read bandwidths
             measured at the start of the run, `benchmarks.timing.memory_bandwidths`), and the
             share of the step that would leave beside the measured GEMM time
             (`non_gemm_floor_share`): below it, the non-GEMM share needs those passes fused
             into the GEMMs
Times: `benchmarks.timing.timed_runs` (implementations in turns, warm-up first, median of the
repeats, device synchronised). Expert-GEMM TFLOP/s count fc1 + fc2 of the M = tokens * top_k
real rows (forward 2*M*H*(F1 + F), F1 = 2F with a GLU; train 3x the forward).
Stage breakdown (`benchmarks.layer_stages`): a JAX profile of a few steps of every jaxmoe
variant, each kernel attributed to a stage, forward / backward and GEMM / quantize / other.
Writes layer_<date>[_tag].json (after every shape: environment, records, stage breakdowns,
summary, errors), layer_<date>[_tag]_kernels.json (the attributed kernels of one profiled step
per jaxmoe variant and mode, with the profile's record formats) and layer_<date>[_tag].png to
--out; prints a summary at the end.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import functools
import gc
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any, NamedTuple

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp
import torch
from flax import nnx

from benchmarks import report
from benchmarks.layer_competitors import (
    check_supported,
    jax_moe,
    torch_dense_gemms,
    torch_moe,
)
from benchmarks.layer_stages import STAGES, describe_profile, stage_breakdown
from benchmarks.report import add_output_arguments, error_text, log
from benchmarks.timing import memory_bandwidths, profile_events, sync, timed_runs
from jaxmoe import MoE
from jaxmoe.shapes import SHAPES, TINY_SHAPES, LayerShape

BF16, F32 = jnp.bfloat16, jnp.float32
MODES = ("train", "inference")


class Variant(NamedTuple):
    """A jaxmoe implementation: its precision (`LayerShape.with_precision`), dense_impl, and
    whether the step takes the experts' quantized copies made beforehand (`cached_weights`)."""

    precision: str
    dense_impl: str | None = None
    cached_weights: bool = False


JAXMOE = {
    "jaxmoe_bf16": Variant("bf16"),
    "jaxmoe_bf16_xla_dense": Variant("bf16", "xla"),
    "jaxmoe_mxfp8": Variant("mxfp8"),
    "jaxmoe_fp8_blockwise": Variant("fp8_blockwise"),
    "jaxmoe_mxfp8_cached_weights": Variant("mxfp8", cached_weights=True),
    "jaxmoe_fp8_blockwise_cached_weights": Variant("fp8_blockwise", cached_weights=True),
}
COMPETITORS = ("torch_grouped_mm", "torch_compile", "jax_ragged_dot", "dense_gemms")
UNCHECKED = ("dense_gemms",)  # no MoE outputs to compare
REFERENCE = "jaxmoe_bf16"
PROFILE_STEPS = 3
# The bandwidth measurement's buffer: 1 GiB on a GPU (well past its L2), 16 MiB on a CPU.
BANDWIDTH_BYTES = {True: 1 << 30, False: 1 << 24}


# ------------------------------------------------------------------------------- programs
def flat_arrays(state) -> dict[str, Any]:
    """An nnx State as {"router.kernel": array, ...} (the competitors' weight names)."""
    return {".".join(map(str, path)): variable[...] for path, variable in nnx.to_flat_state(state)}


def init_weights(shape: LayerShape):
    """(params, other state) of a bf16-parameter `jaxmoe.MoE` for `shape` (nnx.Rngs(0)), made
    in one compiled call."""
    return jax.jit(
        lambda: nnx.split(
            MoE(shape.config, shape.hidden_size, param_dtype=BF16, rngs=nnx.Rngs(0)), nnx.Param, ...
        )[1:]
    )()


def jaxmoe_graphdef(shape: LayerShape, dense_impl: str | None):
    """The graph of a bf16-parameter `jaxmoe.MoE` for `shape` (no weights are made)."""
    abstract = nnx.eval_shape(
        lambda: MoE(
            shape.config,
            shape.hidden_size,
            param_dtype=BF16,
            dense_impl=dense_impl,
            rngs=nnx.Rngs(0),
        )
    )
    return nnx.graphdef(abstract)


def jaxmoe_forward(graphdef, params, rest, x):
    """(y, aux loss, tokens per expert) of the jaxmoe layer."""
    y, aux = nnx.merge(graphdef, params, rest)(x)
    return y, aux.total_loss, aux.tokens_per_expert


def jaxmoe_forward_cached_weights(graphdef, params, fixed, x):
    """`jaxmoe_forward` on the experts' quantized copies made beforehand: fixed = (rest,
    `MoE.quantize_expert_weights()`)."""
    rest, copies = fixed
    y, aux = nnx.merge(graphdef, params, rest)(x, expert_weights=copies)
    return y, aux.total_loss, aux.tokens_per_expert


def jaxmoe_expert_copies(graphdef, params, rest):
    """The layer's `quantize_expert_weights()`: one optimizer step's fp8 expert copies."""
    return nnx.merge(graphdef, params, rest).quantize_expert_weights()


def jaxmoe_routing(graphdef, params, rest, x):
    """The [T, k] expert ids jaxmoe's router picks for x."""
    model = nnx.merge(graphdef, params, rest)
    return model.router(x.reshape(-1, model.hidden_size), model.dense_impl)[1].indices


def ragged_forward(shape: LayerShape, weights, fixed, x):
    """`layer_competitors.jax_moe` on trainable `weights` and the fixed expert bias."""
    return jax_moe({**weights, **fixed}, x, shape.config, shape.seq_len)


def jax_steps(forward: Callable) -> tuple[Callable, Callable]:
    """(train, inference) functions of a JAX forward(trainable, fixed, x) -> (y, aux loss,
    extra): train(trainable, fixed, x, dy) -> (loss, extra, d x, d trainable)."""

    def loss(trainable, x, fixed, dy):
        y, aux_loss, extra = forward(trainable, fixed, x)
        return jnp.sum(y.astype(F32) * dy.astype(F32)) + aux_loss, extra

    def train(trainable, fixed, x, dy):
        (value, extra), (d_trainable, d_x) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
            trainable, x, fixed, dy
        )
        return value, extra, d_x, d_trainable

    return train, forward


def torch_steps(forward: Callable, weights: dict, fixed: dict) -> tuple[Callable, Callable]:
    """(train, inference) of a torch forward(w, x) -> (y, aux loss, extra), same outputs as
    `jax_steps`; autograd through x and every trainable weight."""

    def train(x, dy):
        x = x.detach().requires_grad_(True)
        y, aux_loss, extra = forward({**weights, **fixed}, x)
        value = (y.float() * dy.float()).sum() + aux_loss
        grads = torch.autograd.grad(value, [x, *weights.values()])
        return value.detach(), extra, grads[0], dict(zip(weights, grads[1:]))

    def inference(x):
        with torch.no_grad():
            return forward({**weights, **fixed}, x)

    return train, inference


def comparable(out, mode: str, num_tokens: int) -> dict:
    """The outputs of a train / inference call by name, tokens flattened to [T, ...] (torch
    tensors become JAX arrays sharing their memory; integer ones int32 copies)."""

    def as_jax(a):
        if type(a).__module__.startswith("torch"):
            a = a.detach() if a.is_floating_point() else a.detach().int()
            return jax.dlpack.from_dlpack(a.contiguous())
        return a

    out = jax.tree.map(as_jax, out)
    if mode == "train":  # the loss (a sum of products of both signs) is left out
        _, _, d_x, d_weights = out
        d_weights = d_weights if isinstance(d_weights, dict) else flat_arrays(d_weights)
        return {"dx": d_x.reshape(num_tokens, -1), **d_weights}
    y, aux_loss, extra = out
    named = {"y": y.reshape(num_tokens, -1), "aux_loss": aux_loss}
    if extra.ndim == 2:  # a competitor's [T, k] expert ids
        named["indices"] = extra
    return named


@jax.jit
def rel_error(a, b):
    """||a - b|| / ||b|| in fp32."""
    a, b = a.astype(F32).ravel(), b.astype(F32).ravel()
    return jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30)


@jax.jit
def same_routing(a, b):
    """[T] bool: whether a token's set of k experts is the same in two [T, k] id arrays."""
    return jnp.all(jnp.sort(a.astype(jnp.int32), 1) == jnp.sort(b.astype(jnp.int32), 1), axis=1)


def compare(outputs: dict, reference: dict, reference_indices) -> dict:
    """Relative errors of every output the reference has; with expert ids, the share of tokens
    routed differently and the error of y over the tokens routed alike."""
    errors = {
        name: float(rel_error(value, reference[name]))
        for name, value in outputs.items()
        if name in reference
    }
    result = dict(rel_error=errors, max_rel_error=max(errors.values(), default=None))
    if "indices" in outputs and reference_indices is not None:
        agree = same_routing(outputs["indices"], reference_indices)
        result["routing_mismatch"] = 1.0 - float(jnp.mean(agree))
        errors["y_routed_alike"] = float(
            rel_error(outputs["y"] * agree[:, None], reference["y"] * agree[:, None])
        )
    return result


def expert_gemm_flops(shape: LayerShape, mode: str) -> float:
    """fc1 + fc2 FLOPs of the M = tokens * top_k real rows (train: 3x the forward)."""
    config = shape.config
    rows = shape.num_tokens * config.top_k
    forward = 2.0 * rows * shape.hidden_size * (config.fc1_output_size + config.ffn_hidden_size)
    return forward * (3 if mode == "train" else 1)


def unfused_stage_bytes(shape: LayerShape, mode: str) -> dict[str, int]:
    """HBM bytes of jaxmoe's dispatch, activation and combine as separate passes, each bf16
    value read once and written once: the least traffic of those stages unless the GEMMs take
    them in. T tokens, M = T * top_k rows (dropless, no padding), H, F, F1 = 2F with a GLU:
      dispatch    forward reads x [T, H], writes rows [M, H]; backward the reverse
      activation  forward reads h [M, F1], writes a [M, F]; backward reads h and d a,
                  writes d h [M, F1]
      combine     forward reads [M, H], writes y [T, H]; backward the reverse
    Train counts both passes, inference the forward. The router, plan, aux losses and shared
    expert move bytes too, so the floor is low."""
    config = shape.config
    t, h, f, f1 = (
        shape.num_tokens,
        shape.hidden_size,
        config.ffn_hidden_size,
        config.fc1_output_size,
    )
    m, size = t * config.top_k, 2
    forward = dict(dispatch=t * h + m * h, activation=m * f1 + m * f, combine=m * h + t * h)
    backward = dict(dispatch=m * h + t * h, activation=2 * m * f1 + m * f, combine=t * h + m * h)
    train = mode == "train"
    return {k: size * (forward[k] + (backward[k] if train else 0)) for k in forward}


# -------------------------------------------------------------------------------- one shape
class Candidate(NamedTuple):
    """One implementation of one mode, ready to run."""

    impl: str
    call: Callable
    compile_s: float
    hlo_text: str | None  # the compiled HLO of a jaxmoe variant (stage attribution)


def _timed(fn):
    """(fn(), seconds) or (the exception, seconds)."""
    start = time.perf_counter()
    try:
        return fn(), time.perf_counter() - start
    except Exception as e:  # recorded by the caller
        return e, time.perf_counter() - start


class ShapeBench:
    """The benchmark of one layer shape: builds every implementation, checks, times and
    profiles them, and appends the records to `result` and the profiled kernels to
    `kernels`."""

    def __init__(self, shape: LayerShape, args, result: dict, kernels: dict):
        self.shape, self.args, self.result, self.kernels = shape, args, result, kernels
        self.params, self.rest = init_weights(shape)
        key_x, key_dy = jax.random.split(jax.random.key(1))
        self.x = jax.random.normal(key_x, (shape.batch, shape.seq_len, shape.hidden_size), BF16)
        self.dy = jax.random.normal(key_dy, self.x.shape, BF16)
        self.tokens = shape.num_tokens

    def run(self) -> None:
        """Build, check, time and profile every implementation in every mode."""
        programs = self._jax_programs()
        compiled: dict = {}
        with concurrent.futures.ThreadPoolExecutor(
            max_workers=max(1, min(len(programs), os.cpu_count() or 1))
        ) as pool:
            futures = {}
            for key, (fn, fn_args) in programs.items():
                lowered, seconds = _timed(lambda: jax.jit(fn).lower(*fn_args))
                if isinstance(lowered, Exception):
                    compiled[key] = (lowered, seconds)
                else:
                    futures[key] = (pool.submit(_timed, lowered.compile), seconds)
            log(f"{self.shape.name}: {len(futures)} JAX programs compiling")
            torch_candidates = self._torch_candidates()
            for key, (future, lower_s) in futures.items():
                result, compile_s = future.result()
                compiled[key] = (result, lower_s + compile_s)
        log(f"{self.shape.name}: compiled")
        routing = compiled.pop(("routing", "inference"), (None, 0))[0]
        indices = (
            None
            if routing is None or isinstance(routing, Exception)
            else _timed(lambda: routing(self.params, self.rest, self.x))[0]
        )
        indices = None if isinstance(indices, Exception) else indices
        for mode in self.args.modes:
            candidates = []
            for impl in [*JAXMOE, "jax_ragged_dot"]:
                if (impl, mode) not in compiled:
                    continue
                executable, seconds = compiled.pop((impl, mode))
                if isinstance(executable, Exception):
                    self._record(mode, impl, error=error_text(executable), compile_s=seconds)
                    continue
                fn_args = programs[(impl, mode)][1]
                hlo_text = executable.as_text() if impl in JAXMOE and self.args.profile else None
                candidates.append(
                    Candidate(impl, functools.partial(executable, *fn_args), seconds, hlo_text)
                )
            candidates += torch_candidates.get(mode, [])
            self._bench_mode(mode, candidates, indices)

    def _jax_programs(self) -> dict:
        """(impl, mode) -> (function, arguments) of the JAX implementations (and the jaxmoe
        routing, for the competitors' routing check)."""
        shape, params, rest, x, dy = self.shape, self.params, self.rest, self.x, self.dy
        programs = {}
        for impl, variant in JAXMOE.items():
            if impl not in self.args.impls:
                continue
            graphdef = jaxmoe_graphdef(shape.with_precision(variant.precision), variant.dense_impl)
            forward, fixed = jaxmoe_forward, rest
            if variant.cached_weights:  # made once here, outside the timed steps
                copies = jax.jit(functools.partial(jaxmoe_expert_copies, graphdef))
                forward, fixed = jaxmoe_forward_cached_weights, (rest, copies(params, rest))
            train, inference = jax_steps(functools.partial(forward, graphdef))
            programs[(impl, "train")] = (train, (params, fixed, x, dy))
            programs[(impl, "inference")] = (inference, (params, fixed, x))
        if "jax_ragged_dot" in self.args.impls:
            train, inference = jax_steps(functools.partial(ragged_forward, shape))
            weights, fixed = flat_arrays(params), flat_arrays(rest)
            x_tokens, dy_tokens = x.reshape(self.tokens, -1), dy.reshape(self.tokens, -1)
            programs[("jax_ragged_dot", "train")] = (train, (weights, fixed, x_tokens, dy_tokens))
            programs[("jax_ragged_dot", "inference")] = (inference, (weights, fixed, x_tokens))
        if set(self.args.impls) & set(COMPETITORS) and "inference" in self.args.modes:
            graphdef = jaxmoe_graphdef(shape, None)
            programs[("routing", "inference")] = (
                functools.partial(jaxmoe_routing, graphdef),
                (params, rest, x),
            )
        return {
            key: value
            for key, value in programs.items()
            if key[1] in self.args.modes or key[0] == "routing"
        }

    def _torch_candidates(self) -> dict:
        """mode -> torch Candidates, warmed up (torch.compile's compilation happens here)."""
        candidates = {}
        if "dense_gemms" in self.args.impls:
            calls = torch_dense_gemms(
                self.shape.config,
                self.tokens,
                self.shape.hidden_size,
                torch.from_dlpack(self.x).device,
            )
            for mode, call in zip(MODES, calls, strict=True):
                if mode in self.args.modes:
                    _, seconds = _timed(lambda c=call: sync(c()))
                    candidates.setdefault(mode, []).append(
                        Candidate("dense_gemms", call, seconds, None)
                    )
        wanted = [c for c in ("torch_grouped_mm", "torch_compile") if c in self.args.impls]
        if not wanted:
            return candidates
        if "torch_compile" in wanted:  # no graphs of earlier shapes (dynamo's
            torch._dynamo.reset()  # cache is keyed by code, not by shape)
        config, seq_len = self.shape.config, self.shape.seq_len
        try:
            check_supported(config)
        except NotImplementedError as e:
            for mode in self.args.modes:
                for impl in wanted:
                    self._record(mode, impl, error=error_text(e))
            return candidates
        # torch views of the JAX arrays (DLPack, no copies)
        weights = {
            name: torch.from_dlpack(a).requires_grad_(True)
            for name, a in flat_arrays(self.params).items()
        }
        fixed = {name: torch.from_dlpack(a) for name, a in flat_arrays(self.rest).items()}
        x = torch.from_dlpack(self.x.reshape(self.tokens, -1))
        dy = torch.from_dlpack(self.dy.reshape(self.tokens, -1))

        def forward(w, tokens):
            return torch_moe(w, tokens, config, seq_len)

        for impl in wanted:
            impl_forward = (
                torch.compile(forward, dynamic=False) if impl == "torch_compile" else forward
            )
            train, inference = torch_steps(impl_forward, weights, fixed)
            for mode, call in (
                ("train", lambda t=train: t(x, dy)),
                ("inference", lambda i=inference: i(x)),
            ):
                if mode not in self.args.modes:
                    continue
                out, seconds = _timed(lambda c=call: sync(c()))
                if isinstance(out, Exception):
                    self._record(mode, impl, error=error_text(out), compile_s=seconds)
                    continue
                candidates.setdefault(mode, []).append(Candidate(impl, call, seconds, None))
                log(f"{self.shape.name} {mode}: {impl} warmed up in {seconds:.1f} s")
        return candidates

    def _bench_mode(self, mode: str, candidates: list, indices) -> None:
        """Check every candidate against jaxmoe_bf16, time them in turns, profile jaxmoe's."""
        name = self.shape.name
        checks, reference, runnable = {}, None, []
        for candidate in candidates:
            out, _ = _timed(lambda: sync(candidate.call()))
            if isinstance(out, Exception):
                self._record(
                    mode, candidate.impl, error=error_text(out), compile_s=candidate.compile_s
                )
                continue
            if candidate.impl in UNCHECKED:
                runnable.append(candidate)
                continue
            outputs = comparable(out, mode, self.tokens)
            if candidate.impl == REFERENCE:
                reference = outputs
            elif reference is not None:
                checks[candidate.impl] = compare(outputs, reference, indices)
            del out, outputs
            runnable.append(candidate)
        del reference
        log(f"{name} {mode}: checked {[c.impl for c in runnable]}; timing")
        runs = self._time(mode, runnable)
        flops = expert_gemm_flops(self.shape, mode)
        for candidate in runnable:
            times = runs.get(candidate.impl)
            if isinstance(times, Exception) or times is None:
                self._record(
                    mode,
                    candidate.impl,
                    error=error_text(times or RuntimeError("not timed")),
                    compile_s=candidate.compile_s,
                )
                continue
            seconds = statistics.median(times)
            self._record(
                mode,
                candidate.impl,
                ms=seconds * 1e3,
                ms_runs=[t * 1e3 for t in times],
                tokens_per_s=self.tokens / seconds,
                expert_tflops=flops / seconds / 1e12,
                compile_s=candidate.compile_s,
                **checks.get(candidate.impl, {}),
            )
            log(
                f"{name} {mode}: {candidate.impl:22s} {seconds * 1e3:9.3f} ms "
                f"{flops / seconds / 1e12:7.1f} TF/s"
            )
        for candidate in runnable:
            if candidate.hlo_text is not None:
                self._profile(mode, candidate)

    def _time(self, mode: str, candidates: list) -> dict:
        """impl -> seconds of each timed run, in turns; one at a time if the turns fail."""
        args = self.args
        timing = functools.partial(
            timed_runs, iters=args.iters, repeats=args.repeats, min_window=args.min_window
        )
        try:
            return dict(zip([c.impl for c in candidates], timing([c.call for c in candidates])))
        except Exception as e:  # retried one by one below
            log(f"{self.shape.name} {mode}: timing in turns failed ({error_text(e)[:120]})")
        return {c.impl: _timed(lambda c=c: timing([c.call])[0])[0] for c in candidates}

    def _profile(self, mode: str, candidate: Candidate) -> None:
        """Stage breakdown of a jaxmoe variant from a profile of PROFILE_STEPS calls."""
        try:
            events = profile_events(candidate.call, runs=PROFILE_STEPS)
            breakdown, rows = stage_breakdown(events, candidate.hlo_text, PROFILE_STEPS)
        except Exception as e:  # the timings stand without it
            self.result["errors"].append(
                dict(
                    shape=self.shape.name,
                    mode=mode,
                    impl=candidate.impl,
                    stage="profile",
                    error=error_text(e),
                )
            )
            log(f"{self.shape.name} {mode}: profile of {candidate.impl} failed: {error_text(e)}")
            return
        self.result["stages"].append(
            dict(shape=self.shape.name, mode=mode, impl=candidate.impl, **breakdown)
        )
        self.kernels[f"{self.shape.name}/{mode}/{candidate.impl}"] = dict(
            **describe_profile(events),
            kernels=[
                {k: round(v, 3) if isinstance(v, float) else v for k, v in row._asdict().items()}
                for row in rows
            ],
        )
        log(
            f"{self.shape.name} {mode}: profiled {candidate.impl}: "
            f"{breakdown['device_ms']:.3f} device ms/step ({breakdown['span_ms']:.3f} ms from "
            f"first kernel to last), non-GEMM "
            f"{100 * (breakdown['non_gemm_share'] or 0):.1f}%, matched {breakdown['matched_by']}"
        )

    def _record(self, mode: str, impl: str, **fields) -> None:
        precision = JAXMOE[impl].precision if impl in JAXMOE else "bf16"
        self.result["records"].append(
            dict(shape=self.shape.name, mode=mode, impl=impl, precision=precision, **fields)
        )
        if "error" in fields:
            log(f"{self.shape.name} {mode}: {impl} FAILED {fields['error'][:200]}")


# -------------------------------------------------------------------------------- reporting
def summarize(result: dict) -> list[dict]:
    """Per (shape, mode): jaxmoe_bf16's speedup over every other implementation
    (their ms / its ms), the cost of batch invariance (bf16 / bf16 with XLA dense - 1,
    target <= 5% in train), MXFP8 / bf16, the non-GEMM share of jaxmoe_bf16's device time
    (target <= 10%), torch_grouped_mm's ms over dense_gemms' (the most a layer with
    cuBLAS-speed GEMMs can gain over it) and the non-GEMM floor: `unfused_stage_bytes` at the
    run's higher bandwidth (`non_gemm_floor_ms`) and its share beside jaxmoe_bf16's measured
    GEMM time (`non_gemm_floor_share`, the least non-GEMM share without fusion)."""
    bandwidth = max(result.get("bandwidth_bytes_per_s", {}).values(), default=None)
    summary = []
    for shape in dict.fromkeys(r["shape"] for r in result["records"]):
        for mode in MODES:
            ms = {
                r["impl"]: r.get("ms")
                for r in result["records"]
                if r["shape"] == shape and r["mode"] == mode
            }
            if not ms:
                continue
            ours = ms.get(REFERENCE)
            stages = next(
                (
                    s
                    for s in result["stages"]
                    if s["shape"] == shape and s["mode"] == mode and s["impl"] == REFERENCE
                ),
                {},
            )
            xla_dense, mxfp8 = ms.get("jaxmoe_bf16_xla_dense"), ms.get("jaxmoe_mxfp8")
            floor_ms = floor_share = None
            if bandwidth and shape in result["shapes"]:
                stage_bytes = result["shapes"][shape]["unfused_stage_bytes"][mode]
                floor_ms = sum(stage_bytes.values()) / bandwidth * 1e3
                if stages.get("gemm_ms"):
                    floor_share = floor_ms / (stages["gemm_ms"] + floor_ms)
            summary.append(
                dict(
                    shape=shape,
                    mode=mode,
                    jaxmoe_bf16_ms=ours,
                    speedup={
                        impl: value / ours
                        for impl, value in ms.items()
                        if value and ours and impl != REFERENCE
                    },
                    invariance_cost=ours / xla_dense - 1 if ours and xla_dense else None,
                    mxfp8_over_bf16=mxfp8 / ours if ours and mxfp8 else None,
                    dense_gemms_over_torch=(
                        ms["torch_grouped_mm"] / ms["dense_gemms"]
                        if ms.get("torch_grouped_mm") and ms.get("dense_gemms")
                        else None
                    ),
                    non_gemm_share=stages.get("non_gemm_share"),
                    non_gemm_floor_ms=floor_ms,
                    non_gemm_floor_share=floor_share,
                )
            )
    return summary


LABELS = dict(
    zip(
        [*JAXMOE, *COMPETITORS],
        (
            "bf16",
            "xla_dense",
            "mxfp8",
            "fp8_block",
            "mxfp8_cw",
            "fp8_blk_cw",
            "torch",
            "torch.compile",
            "jax_ragged",
            "dense_gemms",
        ),
        strict=True,
    )
)
SHORT_STAGES = {
    "activation": "act",
    "shared_expert": "shared",
    "aux_losses": "aux",
    "unattributed": "unattr",
}


def print_summary(result: dict) -> None:
    """What the lead reads (the main table last): jaxmoe's device ms by stage, the competitors'
    deviations, the failures, then ms per implementation with speedups, expert-GEMM TF/s,
    invariance cost and non-GEMM share."""
    records = result["records"]
    print("\n== jaxmoe device ms per step by stage (fwd+bwd) | gemm / quantize / non-GEMM share ==")
    for s in result["stages"]:
        total = s["device_ms"] or float("nan")
        parts = " ".join(f"{SHORT_STAGES.get(k, k)} {v['ms']:.2f}" for k, v in s["stages"].items())
        print(
            f"{s['shape']:17s} {s['mode']:5.5s} {LABELS[s['impl']]:9s} {s['device_ms']:7.2f} | "
            f"{parts} | {100 * s['gemm_ms'] / total:.0f}/{100 * s['quantize_ms'] / total:.0f}/"
            f"{100 * s['non_gemm_ms'] / total:.1f}%"
        )
    print(
        "\n== deviation from jaxmoe_bf16: max relative error (train: dx and weight gradients; "
        "inference: y) [share of tokens routed differently, y error on the others] =="
    )
    for row in result["summary"]:
        cells = []
        for r in records:
            if (r["shape"], r["mode"]) == (row["shape"], row["mode"]) and r.get(
                "max_rel_error"
            ) is not None:
                mismatch = r.get("routing_mismatch")
                cells.append(
                    f"{LABELS[r['impl']]} {r['max_rel_error']:.1e}"
                    + (
                        f" [{100 * mismatch:.2f}%, {r['rel_error']['y_routed_alike']:.1e}]"
                        if mismatch is not None
                        else ""
                    )
                )
        print(f"{row['shape']:17s} {row['mode']:9s} " + " | ".join(cells))
    for e in [r for r in records if "error" in r] + result["errors"]:
        print(f"FAILED {e['shape']} {e['mode']} {e['impl']}: {e['error'][:150]}")
    print(
        "\n== MoE layer, ms per step (median); (x) = that impl's ms / jaxmoe_bf16's ms; "
        "TF/s: jaxmoe_bf16's expert GEMMs =="
    )
    print(
        f"{'shape':17s} {'mode':9s}"
        + "".join(f"{v:>15s}" for v in LABELS.values())
        + f"{'TF/s':>6s}{'inv.cost':>9s}{'nonGEMM':>8s}"
    )
    for row in result["summary"]:
        mine = {
            r["impl"]: r for r in records if (r["shape"], r["mode"]) == (row["shape"], row["mode"])
        }
        cells = []
        for impl in LABELS:
            record = mine.get(impl)
            if record is None:
                cells.append("-")
            elif "ms" not in record:
                error = record.get("error", "")
                cells.append(
                    "OOM"
                    if "RESOURCE_EXHAUSTED" in error or "out of memory" in error.lower()
                    else "FAIL"
                )
            elif impl in row["speedup"]:
                cells.append(f"{record['ms']:.2f} ({row['speedup'][impl]:.2f})")
            else:
                cells.append(f"{record['ms']:.3f}")
        tflops = mine.get(REFERENCE, {}).get("expert_tflops")
        inv, non_gemm = row["invariance_cost"], row["non_gemm_share"]
        print(
            f"{row['shape']:17s} {row['mode']:9s}"
            + "".join(f"{c:>15s}" for c in cells)
            + (f"{tflops:6.0f}" if tflops else f"{'-':>6s}")
            + (f"{100 * inv:+8.1f}%" if inv is not None else f"{'-':>9s}")
            + (f"{100 * non_gemm:7.1f}%" if non_gemm is not None else f"{'-':>8s}")
        )
    for row in result["summary"]:
        if row.get("dense_gemms_over_torch"):
            print(
                f"{row['shape']:17s} {row['mode']:9s} torch_grouped_mm / dense_gemms = "
                f"{row['dense_gemms_over_torch']:.2f} (the speedup over torch of a layer that "
                "were its expert GEMMs alone at cuBLAS's dense speed)"
            )
    for row in result["summary"]:
        if row.get("non_gemm_floor_share") is not None:
            print(
                f"{row['shape']:17s} {row['mode']:9s} dispatch + activation + combine as "
                f"separate passes take >= {row['non_gemm_floor_ms']:.3f} ms: >= "
                f"{100 * row['non_gemm_floor_share']:.1f}% of the step beside its GEMMs"
            )
    print("targets: invariance cost <= 5% of the train step; non-GEMM <= 10% of the layer")


def plot(result: dict, path: str) -> None:
    """Bars of ms per implementation and shape (train, inference) and the stacked per-stage
    device ms of jaxmoe's bf16 and MXFP8 train steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    shapes = list(dict.fromkeys(r["shape"] for r in result["records"]))
    impls = [*JAXMOE, *COMPETITORS]
    fig, axes = plt.subplots(1, 3, figsize=(18, 4.8))
    width = 0.8 / len(impls)
    for ax, mode in zip(axes, MODES):
        for i, impl in enumerate(impls):
            values = [
                next(
                    (
                        r["ms"]
                        for r in result["records"]
                        if r["shape"] == s and r["mode"] == mode and r["impl"] == impl and "ms" in r
                    ),
                    0,
                )
                for s in shapes
            ]
            ax.bar(np.arange(len(shapes)) + i * width, values, width, label=impl)
        ax.set_xticks(np.arange(len(shapes)) + 0.4 - width / 2)
        ax.set_xticklabels(shapes, fontsize=8)
        ax.set_ylabel("ms per step")
        if any(bar.get_height() > 0 for bar in ax.patches):
            ax.set_yscale("log")
        ax.set_title(f"MoE layer {mode} step")
    axes[0].legend(fontsize=7)
    ax = axes[2]
    variants = [(shape, impl) for shape in shapes for impl in ("jaxmoe_bf16", "jaxmoe_mxfp8")]
    bottom = np.zeros(len(variants))
    for i, stage in enumerate(STAGES + ("other", "unattributed")):
        values = np.array(
            [
                next(
                    (
                        s["stages"].get(stage, {}).get("ms", 0)
                        for s in result["stages"]
                        if s["shape"] == shape and s["mode"] == "train" and s["impl"] == impl
                    ),
                    0,
                )
                for shape, impl in variants
            ]
        )
        ax.bar(
            np.arange(len(variants)), values, 0.6, bottom=bottom, label=stage, color=plt.cm.tab20(i)
        )
        bottom += values
    ax.set_xticks(np.arange(len(variants)))
    ax.set_xticklabels([f"{shape}\n{impl[7:]}" for shape, impl in variants], fontsize=7)
    ax.set_ylabel("device ms per train step")
    ax.set_title("jaxmoe train step by stage")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(result: dict, kernels: dict, paths: dict) -> None:
    """The JSON files (rewritten after every shape) and the plot."""
    result["summary"] = summarize(result)
    with open(paths["json"], "w") as f:
        json.dump(result, f, indent=1)
    with open(paths["kernels"], "w") as f:
        json.dump(kernels, f)
    try:
        plot(result, paths["png"])
    except ImportError as e:  # matplotlib missing: no plot
        log(f"no plot ({error_text(e)})")


def environment() -> dict:
    """Device, versions and date of the run."""
    return report.environment(
        "layer", num_sms=getattr(jax.devices()[0], "core_count", None), torch=torch.__version__
    )


def main(argv=None):
    """Parse the command line (`argv`: None for sys.argv), benchmark every shape in turn,
    writing the results after each, and print the summary."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shapes",
        default=",".join(SHAPES),
        help=f"comma-separated, from {list(SHAPES)} (CPU smoke sizes: {list(TINY_SHAPES)})",
    )
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument(
        "--impls",
        default=",".join([*JAXMOE, *COMPETITORS]),
        help="comma-separated implementations to run",
    )
    parser.add_argument(
        "--no-competitors", action="store_true", help="only the jaxmoe variants of --impls"
    )
    parser.add_argument("--no-profile", dest="profile", action="store_false")
    parser.add_argument("--iters", type=int, default=1, help="the fewest calls per timed run")
    parser.add_argument(
        "--min-window",
        type=float,
        default=0.1,
        help="seconds: the shortest timed run of back-to-back calls",
    )
    parser.add_argument("--repeats", type=int, default=3)
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    args.impls = [
        i for i in args.impls.split(",") if i and not (args.no_competitors and i in COMPETITORS)
    ]
    for value, allowed in ((args.modes, MODES), (args.impls, (*JAXMOE, *COMPETITORS))):
        if set(value) - set(allowed):
            parser.error(f"unknown {sorted(set(value) - set(allowed))}; choose from {allowed}")
    shapes = {**SHAPES, **TINY_SHAPES}
    names = [s for s in args.shapes.split(",") if s]
    if set(names) - set(shapes):
        parser.error(f"unknown shapes {sorted(set(names) - set(shapes))}")
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(
        args.out,
        f"layer_{datetime.date.today().isoformat()}" + (f"_{args.tag}" if args.tag else ""),
    )
    paths = dict(json=stem + ".json", kernels=stem + "_kernels.json", png=stem + ".png")
    result = dict(
        **environment(),
        shapes={},
        records=[],
        stages=[],
        summary=[],
        errors=[],
        method=f"median of {args.repeats} timed runs of back-to-back calls (>= "
        f"{args.iters} calls and >= {args.min_window} s each, device "
        "synchronised), implementations in turns, each timed run after as "
        "many untimed calls of the same implementation; stage breakdown from "
        f"a JAX profile of {PROFILE_STEPS} steps",
    )
    kernels: dict = {}
    on_gpu = jax.devices()[0].platform == "gpu"
    result["bandwidth_bytes_per_s"] = memory_bandwidths(
        args.repeats, args.min_window, BANDWIDTH_BYTES[on_gpu]
    )
    log(
        f"layer benchmark on {result['device']}: shapes {names}, modes {args.modes}, "
        f"implementations {args.impls}, profile {args.profile}"
    )
    for name in names:
        shape = shapes[name]
        result["shapes"][name] = dict(
            tokens=shape.num_tokens,
            batch=shape.batch,
            seq_len=shape.seq_len,
            hidden=shape.hidden_size,
            **{
                k: v
                for k, v in vars(shape.config).items()
                if isinstance(v, (int, float, str, type(None)))
            },
            expert_gemm_gflop={m: expert_gemm_flops(shape, m) / 1e9 for m in MODES},
            unfused_stage_bytes={m: unfused_stage_bytes(shape, m) for m in MODES},
        )
        log(f"{name}: start")
        try:
            ShapeBench(shape, args, result, kernels).run()
        except Exception as e:  # the other shapes still run
            result["errors"].append(dict(shape=name, mode="-", impl="-", error=error_text(e)))
            log(f"{name}: FAILED {error_text(e)}")
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        write_outputs(result, kernels, paths)
        log(f"{name}: done, wrote {paths['json']}")
    print_summary(result)
    print(f"wrote {', '.join(path for path in paths.values() if os.path.exists(path))}")


if __name__ == "__main__":
    main()

"""The layer as a user runs it on the GPU, at real sizes (`make test-gpu`, on an H100/H200).

For every layer size of `jaxmoe.shapes` in bf16 and MXFP8, with the default `gmm_impl="auto"`
(every matmul and quantize on the Pallas kernels):
  D1  run to run: the training step (loss, y, d x, every parameter gradient) gives the same bits
      twice, and in a separately compiled executable; no library GEMM (cuBLAS, cuDNN, Triton)
      is left in the compiled step, so no autotuner choice can change bits between processes.
  D2  batch invariance: a token's output bits are the same alone (most experts then empty), in
      the first half of the batch, in the reversed batch, and next to padding tokens.
  D3  the training forward (inside the gradient) equals the inference forward bitwise.
  NaN isolation, the kernels against `gmm_impl="xla"` within stated bounds, and one training
  step that lowers the loss.
Negative controls: a one-element change of the input changes the step's bits; XLA's dot (what
the router ran on before, cuBLAS on the GPU) gives a token other router logits alone than in the
batch, and other logits than the kernel.

`--layer-shapes tiny` runs the suite on CPU with the kernels in the Mosaic GPU interpreter (to
check the suite itself; it is slow there). `--results-json` writes the record (conftest.py).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import re
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxmoe import MoE, MoEConfig, mxfp8_inference
from jaxmoe.ops import Mxfp8Kernel, on_hopper
from jaxmoe.ordered import sum_in_order
from jaxmoe.routing import router_logits
from jaxmoe.shapes import SHAPES, LayerShape

from bitwise import assert_bitwise, bits, differs

pytestmark = pytest.mark.gpu

F32, BF16 = jnp.float32, jnp.bfloat16
TINY = LayerShape(
    "tiny",
    MoEConfig(
        num_experts=8,
        top_k=2,
        ffn_hidden_size=128,  # K and N of every expert GEMM multiples of 128 (the decode kernel)
        aux_loss_coeff=1e-2,
        shared_expert_intermediate_size=64,
        shared_expert_gate=True,
    ),
    256,
    batch=2,
    seq_len=32,
)
XLA_COMPARISON_TOKENS = 256  # sequence length of the kernels-vs-XLA comparison (batch 1)
# Library GEMMs in compiled HLO: cuBLAS / cuDNN custom calls, XLA's Triton GEMM fusions. (A
# plain "__triton" fusion is XLA's Triton code for reductions and elementwise work.)
LIBRARY_GEMM = re.compile(r"__cublas|__cudnn|__triton_gemm|__triton_nested_gemm|__triton_scaled")
FUSION_CONFIG = re.compile(
    r"^\s*(?:ROOT )?(%\S+) = .* fusion\(.*, kind=k\w+, .*backend_config=(\{.*\})\s*$"
)


def pytest_generate_tests(metafunc):
    if "case" in metafunc.fixturenames:
        shapes = metafunc.config.getoption("--layer-shapes").split(",")
        precisions = metafunc.config.getoption("--layer-precisions").split(",")
        cases = [(s, p) for s in shapes for p in precisions]
        metafunc.parametrize("case", cases, ids=[f"{s}-{p}" for s, p in cases], scope="module")


@pytest.fixture(scope="module")
def kernels_here():
    """(impl, context): on a CPU (the `tiny` check of the suite), the kernels run in the
    interpreter, a mode that each compiling thread enters again."""
    if on_hopper():
        yield "auto", contextlib.nullcontext
        return
    interpreted = functools.partial(
        plgpu.force_gpu_interpret_mode, plgpu.InterpretGPUParams(detect_races=False)
    )
    with interpreted():
        yield "pallas", interpreted


class Layer:
    """One layer size and precision: the model, its input and upstream gradient, and every
    program the checks run, compiled at once in parallel threads (XLA compiles without the GIL;
    a case's compile time is then its slowest program's, not their sum):
      train, train_again    the training step, compiled twice (D1 separately compiled)
      forward per x shape   the inference forward: the batch, one token, the first half
      small_train, small_train_xla   the step on XLA_COMPARISON_TOKENS tokens, on the kernels
                            and on gmm_impl="xla" (same weights)."""

    def __init__(
        self, shape: LayerShape, precision: str, impl: str, context, seed: int = 0, progress=print
    ):
        self.shape, self.precision, self.impl, self.progress = shape, precision, impl, progress
        self.config = shape.with_precision(precision).config
        self.model = self.build(impl, seed)
        self.graphdef, self.params, self.rest = nnx.split(self.model, nnx.Param, ...)
        kx, kdy = jax.random.split(jax.random.key(seed + 1))
        dims = (shape.batch, shape.seq_len, shape.hidden_size)
        self.x = jax.random.normal(kx, dims, F32).astype(BF16)
        self.dy = jax.random.normal(kdy, dims, F32)
        self.small_x = self.x[:1, :XLA_COMPARISON_TOKENS]
        self.small_dy = self.dy[:1, :XLA_COMPARISON_TOKENS]
        xla_graphdef, self.xla_params, xla_rest = nnx.split(self.build("xla", seed), nnx.Param, ...)
        half = (shape.batch, shape.seq_len // 2)
        lowering = {
            "train": lambda: self.lower_train(self.params, self.x, self.dy),
            "train_again": lambda: self.lower_train(self.params, self.x, self.dy),
            "small_train": lambda: self.lower_train(self.params, self.small_x, self.small_dy),
            "small_train_xla": lambda: self.lower_train(
                self.xla_params, self.small_x, self.small_dy, xla_graphdef, xla_rest
            ),
            **{
                ("forward", batch): functools.partial(self.lower_forward, batch)
                for batch in (dims[:2], (1, 1), half)
            },
        }
        lowered = {}
        for key, lower in lowering.items():
            start = time.perf_counter()
            lowered[key] = lower()
            self.progress(f"lowered {key} in {time.perf_counter() - start:.1f} s")

        def compile_timed(item):
            key, program = item
            with context():
                start = time.perf_counter()
                compiled = program.compile()
            seconds = time.perf_counter() - start
            self.progress(f"compiled {key} in {seconds:.1f} s")
            return compiled, seconds

        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(lowered)) as pool:
            done = dict(zip(lowered, pool.map(compile_timed, lowered.items())))
        self.compile_wall_seconds = time.perf_counter() - start
        self.compile_seconds = {str(k): round(v[1], 2) for k, v in done.items()}
        self.programs = {k: v[0] for k, v in done.items()}
        self.train = self.programs["train"]
        self._routers = {}

    def build(self, impl: str, seed: int) -> MoE:
        model = MoE(
            self.config,
            self.shape.hidden_size,
            param_dtype=BF16,
            gmm_impl=impl,
            rngs=nnx.Rngs(seed),
        )
        if model.router.expert_bias is not None:  # a bias that changes the routing
            bias = jax.random.normal(jax.random.key(seed + 7), (self.config.num_experts,), F32)
            model.router.expert_bias[...] = 0.05 * bias
        return model

    def train_step_fn(self, graphdef, rest):
        """(params, x, dy) -> ((loss, (y, router logits, aux losses)), (d params, d x)) of
        sum(y * dy) + aux losses, the sum over y in a fixed order (an XLA reduce of the harness
        could add in another order in another compilation; the layer's own sums are in order)."""

        def loss(params, x, dy):
            y, aux, stages = nnx.merge(graphdef, params, rest).forward_with_stages(x)
            harness = sum_in_order(jnp.ravel(y.astype(F32) * dy))
            return harness + aux.total_loss, (y, stages.router_logits, aux.total_loss)

        return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)

    def lower_train(self, params, x, dy, graphdef=None, rest=None):
        fn = self.train_step_fn(graphdef or self.graphdef, self.rest if rest is None else rest)
        return jax.jit(fn).lower(params, x, dy)

    def lower_forward(self, batch):
        def fn(params, x, padding_mask):
            model = nnx.merge(self.graphdef, params, self.rest)
            y, aux, stages = model.forward_with_stages(x, padding_mask=padding_mask)
            return y, stages.router_logits, aux.tokens_per_expert

        x = jax.ShapeDtypeStruct(batch + (self.shape.hidden_size,), BF16)
        return jax.jit(fn).lower(self.params, x, jax.ShapeDtypeStruct(batch, bool))

    def forward(self, x, padding_mask=None):
        """(y, router logits [T, E], tokens per expert) of the inference forward."""
        if padding_mask is None:
            padding_mask = jnp.zeros(x.shape[:-1], bool)
        return self.programs["forward", x.shape[:-1]](self.params, x, padding_mask)

    def router_accumulators(self, x, impl):
        """The router's fp32 logits (before any rounding to the router dtype) on `impl`: "xla"
        (XLA's dot, cuBLAS on the GPU: the negative controls) or the layer's own."""
        router = self.model.router
        bias = None if router.bias is None else router.bias[...]
        if impl not in self._routers:
            self._routers[impl] = jax.jit(
                functools.partial(router_logits, router_dtype=F32, impl=impl)
            )
        return self._routers[impl](x.reshape(-1, self.shape.hidden_size), router.kernel[...], bias)


@pytest.fixture(scope="module")
def layer(case, kernels_here, pytestconfig):
    name, precision = case
    shape = TINY if name == "tiny" else SHAPES[name]
    capture = pytestconfig.pluginmanager.getplugin("capturemanager")
    lock = threading.Lock()  # the compiling threads report too

    def progress(message):  # past pytest's capture: where a slow case is
        with lock, capture.global_and_fixture_disabled():
            print(f"[{time.strftime('%H:%M:%S')}] {name}-{precision}: {message}", flush=True)

    built = Layer(shape, precision, *kernels_here, progress=progress)
    yield built
    del built
    jax.clear_caches()


def leaves(tree):
    return [np.asarray(leaf) for leaf in jax.tree.leaves(tree)]


def assert_trees_bitwise(a, b):
    for u, v in zip(leaves(a), leaves(b), strict=True):
        assert_bitwise(u, v)


def differing_leaves(a, b) -> dict[str, int]:
    """{path: number of elements whose bits differ} over the leaves of two like trees."""
    paths = jax.tree_util.tree_flatten_with_path(a)[0]
    return {
        jax.tree_util.keystr(path): int(np.sum(bits(np.atleast_1d(u)) != bits(np.atleast_1d(v))))
        for (path, u), v in zip(paths, leaves(b), strict=True)
        if differs(np.atleast_1d(u), np.atleast_1d(v))
    }


def fusion_configs(hlo_text: str) -> dict[str, str]:
    """{instruction: its fusion backend config} of a compiled module's text (tilings and
    emitter choices that XLA makes while compiling)."""
    return {m[1]: m[2] for m in map(FUSION_CONFIG.match, hlo_text.splitlines()) if m}


def timed(fn, *args):
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return out, time.perf_counter() - start


# ---------------------------------------------------------------------------------------- D1
def test_d1_training_step_run_to_run(layer, record_property):
    first, seconds = timed(layer.train, layer.params, layer.x, layer.dy)
    second = layer.train(layer.params, layer.x, layer.dy)
    assert_trees_bitwise(first, second)
    record_property("compile_seconds", layer.compile_seconds)
    record_property("compile_wall_seconds", round(layer.compile_wall_seconds, 2))
    record_property("train_step_seconds", round(seconds, 4))
    # Negative control: one input element one bf16 ulp up changes the step's bits.
    nudged = layer.x.at[0, 0, 0].set(jnp.nextafter(layer.x[0, 0, 0], jnp.inf).astype(BF16))
    changed = layer.train(layer.params, nudged, layer.dy)
    assert any(differs(u, v) for u, v in zip(leaves(changed), leaves(first)))


def test_d1_separately_compiled_step_gives_the_same_bits(layer, record_property):
    """Every output of the two executables, with the outputs that differ and the XLA fusions
    whose compiled configuration differs recorded (to tell a layer difference from one in the
    harness's own loss sum, and a kernel from an XLA fusion)."""
    again = layer.programs["train_again"]
    assert again is not layer.train
    different = differing_leaves(
        again(layer.params, layer.x, layer.dy), layer.train(layer.params, layer.x, layer.dy)
    )
    if different:
        record_property("differing_outputs", different)
        configs = [fusion_configs(p.as_text()) for p in (layer.train, again)]
        record_property(
            "fusions_compiled_differently",
            {
                name: [configs[0].get(name), configs[1].get(name)]
                for name in sorted(configs[0].keys() | configs[1].keys())
                if configs[0].get(name) != configs[1].get(name)
            },
        )
    assert not different


def test_d1_no_library_gemm_in_the_training_step(layer):
    """Every matmul of the step is one of jaxmoe's kernels (fixed reduction order): no cuBLAS,
    cuDNN or Triton GEMM, whose algorithm an autotuner picks per compilation."""
    assert not LIBRARY_GEMM.findall(layer.train.as_text())
    if on_hopper():  # control: XLA's dot of the tokens with an expert matrix is one
        tokens = layer.x.reshape(-1, layer.shape.hidden_size)
        weight = layer.model.experts.fc1_kernel[0]
        control = (
            jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=F32))
            .lower(tokens, weight)
            .compile()
            .as_text()
        )
        assert LIBRARY_GEMM.findall(control)


# ---------------------------------------------------------------------------------------- D2
def test_d2_batch_invariance(layer, record_property):
    shape = layer.shape
    y, logits, _ = layer.forward(layer.x)
    y, logits = np.asarray(y), np.asarray(logits).reshape(shape.batch, shape.seq_len, -1)
    for b, s in ((0, 0), (shape.batch - 1, shape.seq_len - 1)):
        y_one, logits_one, counts = layer.forward(layer.x[b : b + 1, s : s + 1])
        assert_bitwise(np.asarray(logits_one)[0], logits[b, s])
        assert_bitwise(np.asarray(y_one)[0, 0], y[b, s])
        empty = int(np.sum(np.asarray(counts) == 0))
        assert empty >= layer.config.num_experts - layer.config.top_k
    record_property("empty_experts_token_alone", empty)
    half = shape.seq_len // 2
    assert_bitwise(np.asarray(layer.forward(layer.x[:, :half])[0]), y[:, :half])
    assert_bitwise(np.asarray(layer.forward(layer.x[::-1, ::-1])[0]), y[::-1, ::-1])
    # The last sequence replaced by padding tokens (other values, masked): the rest unchanged.
    garbage = jax.random.normal(jax.random.key(11), layer.x.shape[1:], F32).astype(BF16) * 3
    padded_x = layer.x.at[-1].set(garbage)
    mask = jnp.zeros(layer.x.shape[:-1], bool).at[-1].set(True)
    assert_bitwise(np.asarray(layer.forward(padded_x, mask)[0])[:-1], y[:-1])


def test_d2_router_accumulators_and_negative_control(layer):
    """The router's fp32 accumulators (finer than the rounded logits) of the first token are
    the same bits alone as in the batch on the layer's matmul. Control: on XLA's dot (cuBLAS on
    the GPU) they are not: what the checks above catch when a token-row matmul is not
    invariant."""
    one = layer.x[:1, :1]
    assert_bitwise(
        np.asarray(layer.router_accumulators(one, layer.impl)),
        np.asarray(layer.router_accumulators(layer.x, layer.impl))[:1],
    )
    assert differs(
        np.asarray(layer.router_accumulators(one, "xla")),
        np.asarray(layer.router_accumulators(layer.x, "xla"))[:1],
    )


# ---------------------------------------------------------------------------------------- D3
def test_d3_training_forward_equals_inference_forward(layer):
    (_, (y_train, logits_train, _)), _ = layer.train(layer.params, layer.x, layer.dy)
    y_inference, logits_inference, _ = layer.forward(layer.x)
    assert_bitwise(np.asarray(y_train), np.asarray(y_inference))
    assert_bitwise(np.asarray(logits_train), np.asarray(logits_inference))
    # Control: the same check catches another reduction order of the router's accumulators.
    assert differs(
        np.asarray(layer.router_accumulators(layer.x, "xla")),
        np.asarray(layer.router_accumulators(layer.x, layer.impl)),
    )


def test_d3_mxfp8_inference_layer_equals_the_training_forward(layer):
    """MXFP8 cases: the layer with its experts stored as MXFP8 alone (`jaxmoe.mxfp8_inference`)
    gives the training step's y bitwise, with the default GEMMs (`Mxfp8Kernel.AUTO`: the
    dequantizing kernels for the batch, the decode kernel for a token) and with the decode kernel
    (`kernel=Mxfp8Kernel.DECODE`), for the batch and (D2) for a token alone; its expert state is
    fp8 data and uint8 scales only."""
    model = nnx.merge(layer.graphdef, layer.params, layer.rest)
    if layer.precision != "mxfp8":  # bf16 experts have no MXFP8 copies to keep
        with pytest.raises(ValueError, match="expert_precision='mxfp8'"):
            mxfp8_inference(model)
        return
    (_, (y_train, _, _)), _ = layer.train(layer.params, layer.x, layer.dy)
    y_train = np.asarray(y_train)
    forward = nnx.jit(lambda m, x: m(x)[0])
    inference = mxfp8_inference(model)
    assert_bitwise(y_train, np.asarray(forward(inference, layer.x)))
    assert_bitwise(y_train[:1, :1], np.asarray(forward(inference, layer.x[:1, :1])))
    dtypes = {str(a.dtype) for a in jax.tree.leaves(nnx.state(inference.experts))}
    assert dtypes == {"float8_e4m3fn", "uint8"}
    decode = mxfp8_inference(model, kernel=Mxfp8Kernel.DECODE)
    assert_bitwise(y_train, np.asarray(forward(decode, layer.x)))
    assert_bitwise(y_train[:1, :1], np.asarray(forward(decode, layer.x[:1, :1])))


# ------------------------------------------------------------------------- NaN, XLA, training
def test_nan_token_stays_in_its_row(layer):
    y, _, _ = layer.forward(layer.x)
    poisoned, _, _ = layer.forward(layer.x.at[0, 3, 7].set(jnp.nan))
    poisoned, y = np.asarray(poisoned, np.float32), np.asarray(y, np.float32)
    assert not np.all(np.isfinite(poisoned[0, 3]))
    others = np.ones(poisoned.shape[:2], bool)
    others[0, 3] = False
    assert_bitwise(poisoned[others], y[others])


def test_kernels_match_xla_within_bounds(layer, record_property):
    """The same layer (same weights) on the kernels and on `gmm_impl="xla"`, a batch of 256
    tokens. Bound (normwise, every output and gradient): ||kernel - xla|| <= 2^-5 ||xla||. Both
    accumulate in fp32 and round at the same points, so they differ by accumulation order:
    where an fp32 sum lands on the other side of a bf16 rounding boundary an element moves by
    one ulp (2^-8 relative), at most once per rounding point on its path (router, fc1,
    activation, fc2, combine: 5 x 2^-8 < 2^-5); with MXFP8 such a last-bit difference can move
    a quantized value one e4m3 step (2^-3 relative), seen in ~1% of elements
    (sqrt(1%) x 2^-3 < 2^-5). A near-tie routing decision that flips moves that one token.
    The loss <y, dy> + aux is a sum of terms of either sign, so its own relative error has no
    such bound; by Cauchy-Schwarz |d<y, dy>| <= ||d y|| ||dy||, and it is held to
    2^-5 (||y|| ||dy|| + |aux|)."""
    x, dy = layer.small_x, layer.small_dy
    assert_trees_bitwise(layer.xla_params, layer.params)
    (kernel_loss, kernel_rest), kernel_grads = layer.programs["small_train"](layer.params, x, dy)
    (xla_loss, xla_rest), xla_grads = layer.programs["small_train_xla"](layer.xla_params, x, dy)
    worst = 0.0
    for a, b in zip(
        leaves((kernel_rest, kernel_grads)), leaves((xla_rest, xla_grads)), strict=True
    ):
        a, b = a.astype(np.float64), b.astype(np.float64)
        error = np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)
        worst = max(worst, error)
        assert error <= 2.0**-5
    y, aux = (np.asarray(v, np.float64) for v in (xla_rest[0], xla_rest[2]))
    scale = np.linalg.norm(y) * np.linalg.norm(np.asarray(dy, np.float64)) + abs(float(aux))
    loss_error = abs(float(kernel_loss) - float(xla_loss)) / scale
    assert loss_error <= 2.0**-5
    record_property("worst_normwise_error", worst)
    record_property("loss_error_over_its_bound_scale", loss_error)


def test_training_step_lowers_the_loss(layer, record_property):
    """One gradient step (each parameter moved by 1% of its RMS along its gradient) lowers
    <y, dy> + aux loss; every gradient is finite and not all zero."""
    (loss, _), (grads, d_x) = layer.train(layer.params, layer.x, layer.dy)
    for g in leaves(grads) + [np.asarray(d_x)]:
        g = g.astype(np.float32)
        assert np.all(np.isfinite(g)) and np.any(g)

    def step(p, g):
        p32, g32 = p.astype(F32), g.astype(F32)
        rate = 0.01 * jnp.sqrt(jnp.mean(p32**2) / jnp.maximum(jnp.mean(g32**2), 1e-30))
        return (p32 - rate * g32).astype(p.dtype)

    stepped = jax.tree.map(step, layer.params, grads)
    (new_loss, _), _ = layer.train(stepped, layer.x, layer.dy)
    record_property("loss_before_after", [float(loss), float(new_loss)])
    stats = jax.devices()[0].memory_stats() or {}
    record_property("peak_device_bytes", stats.get("peak_bytes_in_use"))  # sizes the processes
    assert float(new_loss) < float(loss)

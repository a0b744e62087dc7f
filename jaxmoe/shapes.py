"""Real layer sizes: the ones the GPU test suite and the layer benchmark run at (one H200).

name               tokens  H     experts  top-k  F      other
mixtral            8192    4096  8        2      14336  softmax after top-k, aux loss
qwen3_30b          8192    2048  128      8      768    softmax after top-k, aux loss
dsv3_ep8           4096    7168  32       8      2048   DeepSeek-V3's experts on one of 8 EP
                                                        ranks (fc1 GEMM 32768 x 7168 x 4096)
deepseek_v3_style  4096    7168  64       8      2048   sigmoid scores, 8 groups / top-4,
                                                        expert bias, scaling 2.5, fp32 router,
                                                        seq aux loss, gated shared expert 2048
"""

from __future__ import annotations

import dataclasses

from jaxmoe.config import MoEConfig


@dataclasses.dataclass(frozen=True)
class LayerShape:
    """A layer size: `config`, hidden size H and the input [batch, seq_len, H]."""

    name: str
    config: MoEConfig
    hidden_size: int
    batch: int
    seq_len: int

    @property
    def num_tokens(self) -> int:
        return self.batch * self.seq_len

    def with_precision(self, precision: str) -> LayerShape:
        """This shape in "bf16" (as defined), "mxfp8" (experts, dispatch and combine gradient
        in MXFP8, 32-row expert alignment) or "fp8_blockwise" (the same in FP8 blockwise,
        128-row alignment)."""
        return dataclasses.replace(self, config=self.config.with_precision(precision))


SHAPES: dict[str, LayerShape] = {
    shape.name: shape
    for shape in (
        LayerShape(
            "mixtral",
            MoEConfig(num_experts=8, top_k=2, ffn_hidden_size=14336, aux_loss_coeff=1e-2),
            4096,
            batch=2,
            seq_len=4096,
        ),
        LayerShape(
            "qwen3_30b",
            MoEConfig(num_experts=128, top_k=8, ffn_hidden_size=768, aux_loss_coeff=1e-3),
            2048,
            batch=2,
            seq_len=4096,
        ),
        LayerShape(
            "dsv3_ep8",
            MoEConfig(num_experts=32, top_k=8, ffn_hidden_size=2048, aux_loss_coeff=1e-3),
            7168,
            batch=2,
            seq_len=2048,
        ),
        LayerShape(
            "deepseek_v3_style",
            MoEConfig(
                num_experts=64,
                top_k=8,
                ffn_hidden_size=2048,
                score_function="sigmoid",
                enable_expert_bias=True,
                num_groups=8,
                group_topk=4,
                topk_scaling_factor=2.5,
                router_dtype="fp32",
                load_balancing_type="seq_aux_loss",
                aux_loss_coeff=1e-4,
                shared_expert_intermediate_size=2048,
                shared_expert_gate=True,
            ),
            7168,
            batch=2,
            seq_len=2048,
        ),
    )
}

# DeepSeek-V3's MoE layer for expert parallelism at EP = 4 / 8 (`benchmarks/ep.py`):
# deepseek_v3_style's routing with all 256 experts and its one shared expert, ungated; 8192
# tokens per device (2 sequences of 4096).
DEEPSEEK_V3_FULL = LayerShape(
    "deepseek_v3_full",
    SHAPES["deepseek_v3_style"].config.replace(num_experts=256, shared_expert_gate=False),
    7168,
    batch=2,
    seq_len=4096,
)

# CPU smoke-test sizes of the benchmarks (a check of the scripts, not of the layer's speed): a
# Mixtral-like layer and deepseek_v3_style's routing and gated shared expert, small (E = 8 and
# 16 split over up to 8 ranks).
TINY_SHAPES: dict[str, LayerShape] = {
    shape.name: shape
    for shape in (
        LayerShape(
            "tiny",
            MoEConfig(num_experts=8, top_k=2, ffn_hidden_size=64, aux_loss_coeff=1e-2),
            64,
            batch=2,
            seq_len=32,
        ),
        LayerShape(
            "tiny_deepseek",
            SHAPES["deepseek_v3_style"].config.replace(
                num_experts=16,
                top_k=4,
                ffn_hidden_size=64,
                num_groups=4,
                group_topk=2,
                shared_expert_intermediate_size=64,
            ),
            64,
            batch=2,
            seq_len=32,
        ),
    )
}

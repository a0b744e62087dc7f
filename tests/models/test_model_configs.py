"""`LMConfig`: validation, layer kinds, overrides, the JSON round trip, the named configs and
their parameter counts (from shapes alone) against the published ones."""

import dataclasses
import json
import math
import re

import jax.numpy as jnp
import pytest

from jaxmoe import MoEConfig
from jaxmoe.models import BYTE_VOCAB_SIZE, CONFIGS, LMConfig, count_parameters

TINY = CONFIGS["tiny"]


def test_named_configs():
    assert set(CONFIGS) == {"qwen3_30b_a3b", "mixtral_8x7b", "qwen3_moe_2b", "tiny", "tiny_mixtral"}
    assert BYTE_VOCAB_SIZE == 259 == TINY.vocab_size == CONFIGS["tiny_mixtral"].vocab_size
    assert TINY.layer_kinds() == ("dense", "moe", "moe", "moe")
    assert TINY.tie_embeddings and TINY.moe.shared_expert_intermediate_size == 128
    assert CONFIGS["tiny_mixtral"].layer_kinds() == ("moe",) * 4
    qwen = CONFIGS["qwen3_30b_a3b"]
    assert qwen.qk_norm and not qwen.tie_embeddings and qwen.rope_theta == 1e6
    assert not qwen.moe.pre_softmax and qwen.moe.aux_loss_coeff == 1e-3  # softmax after top-k
    bench = CONFIGS["qwen3_moe_2b"]
    assert (bench.num_layers, bench.hidden_size, bench.num_heads, bench.num_kv_heads) == (
        12,
        1024,
        16,
        4,
    )
    assert (bench.head_dim, bench.moe.num_experts, bench.moe.top_k, bench.moe.ffn_hidden_size) == (
        64,
        128,
        8,
        384,
    )


def test_layer_kinds_follow_first_k_dense_and_moe_layer_freq():
    kinds = lambda **c: TINY.replace(num_layers=6, **c).layer_kinds()
    assert kinds(first_k_dense=0) == ("moe",) * 6
    assert kinds(first_k_dense=2) == ("dense", "dense") + ("moe",) * 4
    assert kinds(first_k_dense=0, moe_layer_freq=2) == ("moe", "dense") * 3
    assert kinds(first_k_dense=1, moe_layer_freq=2) == (
        "dense",
        "moe",
        "dense",
        "moe",
        "dense",
        "moe",
    )
    assert kinds(first_k_dense=1, moe_layer_freq=3) == (
        "dense",
        "moe",
        "dense",
        "dense",
        "moe",
        "dense",
    )


@pytest.mark.parametrize(
    "changes, field",
    [
        (dict(vocab_size=0), "vocab_size"),
        (dict(hidden_size=12.0), "hidden_size"),
        (dict(num_layers=True), "num_layers"),
        (dict(num_kv_heads=3), "num_heads"),
        (dict(head_dim=31), "head_dim"),
        (dict(max_position=-1), "max_position"),
        (dict(rope_theta=0.0), "rope_theta"),
        (dict(norm_eps=-1e-6), "norm_eps"),
        (dict(init_std=0), "init_std"),
        (dict(qk_norm=1), "qk_norm"),
        (dict(tie_embeddings="yes"), "tie_embeddings"),
        (dict(moe=None), "moe"),
        (dict(first_k_dense=4), "first_k_dense"),
        (dict(first_k_dense=-1), "first_k_dense"),
        (dict(dense_ffn_hidden_size=None), "dense_ffn_hidden_size"),
        (dict(dense_ffn_hidden_size=0), "dense_ffn_hidden_size"),
        (dict(first_k_dense=0, moe_layer_freq=0), "moe_layer_freq"),
        (dict(remat="some"), "remat"),
        (dict(attention_impl="flash"), "attention_impl"),
        (dict(param_dtype="int32"), "param_dtype"),
        (dict(dtype="float99"), "dtype"),
    ],
)
def test_bad_fields_are_named(changes, field):
    with pytest.raises(ValueError, match=rf"LMConfig\.{field}:"):
        TINY.replace(**changes)


def test_dense_ffn_size_only_needed_with_a_dense_layer():
    config = TINY.replace(first_k_dense=0, dense_ffn_hidden_size=None)
    assert config.layer_kinds() == ("moe",) * 4
    with pytest.raises(ValueError, match="dense_ffn_hidden_size"):
        config.replace(moe_layer_freq=2)


def test_dtypes_are_stored_by_name():
    config = TINY.replace(param_dtype=jnp.bfloat16, dtype=jnp.dtype("float32"))
    assert (config.param_dtype, config.dtype) == ("bfloat16", "float32")
    assert config == TINY.replace(param_dtype="bfloat16", dtype="float32")


def test_with_overrides():
    config = TINY.with_overrides({"moe.top_k": 4, "num_layers": 2, "moe.z_loss_coeff": None})
    assert (config.moe.top_k, config.num_layers, config.moe.z_loss_coeff) == (4, 2, None)
    assert config.moe.num_experts == TINY.moe.num_experts and config.hidden_size == 128
    assert TINY.with_overrides({}) == TINY
    moe = MoEConfig(num_experts=4, ffn_hidden_size=64)
    assert TINY.with_overrides({"moe": moe, "moe.top_k": 1, "moe.pre_softmax": True}).moe == (
        moe.replace(top_k=1, pre_softmax=True)
    )
    for key in ("num_layer", "moe.topk", "moe.top_k.x", "num_layers.x", "moe.", ""):
        with pytest.raises(ValueError, match=re.escape(f"unknown key '{key}'")):
            TINY.with_overrides({key: 1})
    with pytest.raises(ValueError, match=r"MoEConfig\.top_k: must be <= num_experts"):
        TINY.with_overrides({"moe.top_k": 9})


def test_dict_round_trip_through_json():
    for config in CONFIGS.values():
        text = json.dumps(config.to_dict())
        assert LMConfig.from_dict(json.loads(text)) == config
    values = TINY.to_dict()
    assert values["moe"]["num_experts"] == 8 and values["dtype"] == "bfloat16"
    with pytest.raises(ValueError, match=r"LMConfig.from_dict: unknown keys \['extra'\]"):
        LMConfig.from_dict({**values, "extra": 1})
    with pytest.raises(ValueError, match=r"MoEConfig.from_dict: unknown keys \['topk'\]"):
        LMConfig.from_dict({**values, "moe": {**values["moe"], "topk": 2}})
    with pytest.raises(ValueError, match="'moe' must be the MoE config's dict, got None"):
        LMConfig.from_dict({k: v for k, v in values.items() if k != "moe"})
    assert LMConfig.from_dict(values) != TINY.replace(num_layers=3)


def expected_counts(config: LMConfig) -> tuple[int, int]:
    """(total, active) by hand from the config: Mixtral's and Qwen3's layout, every layer MoE."""
    c, moe = config, config.moe
    h, d, layers = c.hidden_size, c.head_dim, c.num_layers
    attention = h * d * (2 * c.num_heads + 2 * c.num_kv_heads) + (2 * d if c.qk_norm else 0)
    expert = 3 * h * moe.ffn_hidden_size  # gate, up and down
    per_layer = attention + h * moe.num_experts + 2 * h  # + router and the two norms
    embeddings = c.vocab_size * h * (1 if c.tie_embeddings else 2)
    dense = layers * per_layer + embeddings + h  # + the final norm
    return dense + layers * moe.num_experts * expert, dense + layers * moe.top_k * expert


def test_parameter_counts_of_the_published_models():
    mixtral, qwen = CONFIGS["mixtral_8x7b"], CONFIGS["qwen3_30b_a3b"]
    counts = {config: count_parameters(config) for config in (mixtral, qwen)}
    for config, count in counts.items():
        assert dataclasses.astuple(count) == expected_counts(config)
    billions = lambda config: (counts[config].total / 1e9, counts[config].active / 1e9)
    assert [round(b, 1) for b in billions(mixtral)] == [46.7, 12.9]
    total, active = billions(qwen)
    assert round(total, 1) == 30.5
    # Qwen's card gives 3.3B active for these 3.353B: cut, not rounded, to 0.1B (the routers'
    # 12.6M, which every token uses, count here; without them it would be 3.340B).
    assert round(active, 3) == 3.353 and math.floor(active * 10) / 10 == 3.3


def test_parameter_counts_of_the_tiny_model():
    count = count_parameters(TINY)
    h, v = 128, 259
    attention = h * 32 * (2 * 4 + 2 * 2) + 2 * h  # + the two norms
    dense_ffn = 3 * h * 512
    router, shared, expert = h * 8, 3 * h * 128, 3 * h * 256
    moe_layers = 3 * (attention + router + shared)
    total = v * h + h + attention + dense_ffn + moe_layers + 3 * 8 * expert
    assert count.total == total  # tied: the embedding once
    assert count.active == total - 3 * 6 * expert

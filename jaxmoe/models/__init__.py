"""jaxmoe's decoder-only MoE language model: `LMConfig` (named ones in `CONFIGS`),
`MoETransformer` and `count_parameters`."""

from jaxmoe.models.attention import attention_impl_used
from jaxmoe.models.config import BYTE_VOCAB_SIZE, CONFIGS, LMConfig
from jaxmoe.models.transformer import (
    KVCache,
    LMAux,
    MoETransformer,
    ParameterCount,
    count_parameters,
)

__all__ = [
    "BYTE_VOCAB_SIZE",
    "CONFIGS",
    "LMConfig",
    "MoETransformer",
    "LMAux",
    "KVCache",
    "ParameterCount",
    "count_parameters",
    "attention_impl_used",
]

"""jaxmoe: a Megatron-Core-compatible Mixture-of-Experts layer for JAX/Flax.

Data path: route -> plan -> dispatch -> grouped expert MLP -> combine (+ shared expert).
"""

from jaxmoe import mxfp8, ops
from jaxmoe.config import PRECISION_PRESETS, MoEConfig, selective_precision
from jaxmoe.dispatch import combine, dispatch, gather_slots
from jaxmoe.expert_parallel import expert_parallel_forward, place_on_mesh
from jaxmoe.inference import mxfp8_inference
from jaxmoe.moe import ExpertBias, MoE, MoEAux, MoEStages, to_linen
from jaxmoe.plan import Plan, make_plan
from jaxmoe.routing import Routing, route, router_logits, update_expert_bias

__all__ = [
    "MoEConfig",
    "PRECISION_PRESETS",
    "selective_precision",
    "MoE",
    "MoEAux",
    "MoEStages",
    "ExpertBias",
    "to_linen",
    "expert_parallel_forward",
    "place_on_mesh",
    "mxfp8_inference",
    "Routing",
    "route",
    "router_logits",
    "update_expert_bias",
    "Plan",
    "make_plan",
    "dispatch",
    "combine",
    "gather_slots",
    "mxfp8",
    "ops",
]

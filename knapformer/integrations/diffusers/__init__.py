"""Balanced training forwards for diffusers transformers (the ``[diffusers]`` extra).

``balance(model)(samples, balancer)``: every declared class (`models.SPECS`: Flux,
Flux 2, Qwen-Image, SD3, Wan, HunyuanVideo, LTX-Video, CogVideoX), each sample given as
the model's own keyword arguments for a batch of one (docs/diffusers.md). The first API,
``BalancedFlux(model)(FluxBatch, balancer)`` and ``BalancedWan(model)(WanBatch,
balancer)``, runs on it.
"""

from knapformer.integrations.diffusers.balanced import (
    BalancedModel,
    BalancedOutputs,
    balance,
)
from knapformer.integrations.diffusers.declarations import JOINT, Blocks, ModelSpec, Tok
from knapformer.integrations.diffusers.flux import BalancedFlux, FluxBatch
from knapformer.integrations.diffusers.models import SPECS
from knapformer.integrations.diffusers.wan import BalancedWan, WanBatch

__all__ = [
    "JOINT",
    "SPECS",
    "BalancedFlux",
    "BalancedModel",
    "BalancedOutputs",
    "BalancedWan",
    "Blocks",
    "FluxBatch",
    "ModelSpec",
    "Tok",
    "WanBatch",
    "balance",
]

"""Balanced training forwards for diffusers models (the ``[diffusers]`` extra).

``BalancedFlux(model)(FluxBatch, balancer)`` for ``FluxTransformer2DModel`` and
``BalancedWan(model)(WanBatch, balancer)`` for ``WanTransformer3DModel``: the model's own
modules and weights, the balancer's routing (docs/diffusers.md).
"""

from knapformer.integrations.diffusers.flux import BalancedFlux, FluxBatch
from knapformer.integrations.diffusers.wan import BalancedWan, WanBatch

__all__ = ["BalancedFlux", "BalancedWan", "FluxBatch", "WanBatch"]

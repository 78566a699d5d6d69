"""Every diffusers internal the balanced forwards rely on, checked in one place.

The forwards call a block's own sub-modules (norms, projections, feed-forwards) instead
of its ``forward``, so they depend on attribute names and shapes that diffusers may
change between releases. `check_flux` / `check_wan` look each one up before the first
step and raise `KnapformerError` naming the first one missing, instead of a wrong result
or an ``AttributeError`` deep inside a step.
"""

from __future__ import annotations

import inspect
from typing import Any

from knapformer.errors import KnapformerError

#: Tested range (pyproject's ``diffusers`` extra).
TESTED = ">=0.42,<0.43"

_FLUX_MODEL = ("x_embedder", "context_embedder", "time_text_embed", "pos_embed",
               "transformer_blocks", "single_transformer_blocks", "norm_out", "proj_out",
               "gradient_checkpointing")  # fmt: skip
_FLUX_NORM_OUT = ("norm_out.linear", "norm_out.norm", "norm_out.silu")
_FLUX_DOUBLE = (
    "norm1.linear", "norm1.norm", "norm1_context.linear", "norm1_context.norm",
    "attn.to_q", "attn.to_k", "attn.to_v", "attn.norm_q", "attn.norm_k",
    "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj",
    "attn.norm_added_q", "attn.norm_added_k", "attn.to_out", "attn.to_add_out",
    "attn.head_dim", "norm2", "ff", "norm2_context", "ff_context",
)  # fmt: skip
_FLUX_SINGLE = ("norm.linear", "norm.norm", "proj_mlp", "act_mlp", "proj_out",
                "attn.to_q", "attn.to_k", "attn.to_v", "attn.norm_q", "attn.norm_k",
                "attn.head_dim")  # fmt: skip
_WAN_MODEL = ("patch_embedding", "rope", "condition_embedder", "blocks", "norm_out",
              "proj_out", "scale_shift_table", "config", "gradient_checkpointing")  # fmt: skip
_WAN_ROPE = ("rope.freqs_cos", "rope.freqs_sin", "rope.t_dim", "rope.h_dim", "rope.w_dim")
_WAN_BLOCK = (
    "scale_shift_table", "norm1", "norm2", "norm3", "ffn",
    "attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.norm_q", "attn1.norm_k",
    "attn1.to_out", "attn1.heads", "attn2.to_q", "attn2.to_k", "attn2.to_v",
    "attn2.norm_q", "attn2.norm_k", "attn2.to_out", "attn2.heads", "attn2.add_k_proj",
)  # fmt: skip


def _lookup(obj: Any, dotted: str, where: str) -> Any:
    for part in dotted.split("."):
        if not hasattr(obj, part):
            raise KnapformerError(
                f"diffusers internal {where}.{dotted} is missing: the balanced forward was "
                f"written against diffusers {TESTED}; check the installed version"
            )
        obj = getattr(obj, part)
    return obj


def _check_all(obj: Any, names: tuple[str, ...], where: str) -> None:
    for name in names:
        _lookup(obj, name, where)


def _check_signature(fn: Any, params: tuple[str, ...], where: str) -> None:
    got = tuple(inspect.signature(fn).parameters)
    if got[: len(params)] != params:
        raise KnapformerError(
            f"diffusers internal {where} takes {got}, expected {params} first "
            f"(written against diffusers {TESTED})"
        )


def _check_unfused(attn: Any, where: str) -> None:
    if getattr(attn, "fused_projections", False):
        raise KnapformerError(
            f"{where} has fused projections; call model.unfuse_qkv_projections() first"
        )


def check_flux(model: Any) -> None:
    """Every internal of ``FluxTransformer2DModel`` the balanced forward uses."""
    _check_all(model, _FLUX_MODEL, "FluxTransformer2DModel")
    _check_all(model, _FLUX_NORM_OUT, "FluxTransformer2DModel")
    _check_signature(type(model.time_text_embed).forward, ("self", "timestep"),
                     "FluxTransformer2DModel.time_text_embed.forward")  # fmt: skip
    _check_signature(type(model.pos_embed).forward, ("self", "ids"),
                     "FluxTransformer2DModel.pos_embed.forward")  # fmt: skip
    for i, block in enumerate(model.transformer_blocks):
        where = f"FluxTransformer2DModel.transformer_blocks[{i}]"
        _check_all(_unwrapped(block), _FLUX_DOUBLE, where)
        _check_unfused(_unwrapped(block).attn, where + ".attn")
    for i, block in enumerate(model.single_transformer_blocks):
        where = f"FluxTransformer2DModel.single_transformer_blocks[{i}]"
        _check_all(_unwrapped(block), _FLUX_SINGLE, where)
        _check_unfused(_unwrapped(block).attn, where + ".attn")


def check_wan(model: Any) -> None:
    """Every internal of ``WanTransformer3DModel`` the balanced forward uses."""
    _check_all(model, _WAN_MODEL, "WanTransformer3DModel")
    _check_all(model, _WAN_ROPE, "WanTransformer3DModel")
    _check_signature(type(model.condition_embedder).forward,
                     ("self", "timestep", "encoder_hidden_states"),
                     "WanTransformer3DModel.condition_embedder.forward")  # fmt: skip
    for i, block in enumerate(model.blocks):
        where = f"WanTransformer3DModel.blocks[{i}]"
        _check_all(_unwrapped(block), _WAN_BLOCK, where)
        if _unwrapped(block).attn2.add_k_proj is not None:
            raise KnapformerError(f"{where}.attn2 has image keys (I2V): not supported yet")
        _check_unfused(_unwrapped(block).attn1, where + ".attn1")


def _unwrapped(module: Any) -> Any:
    """The block inside torch's ``checkpoint_wrapper`` (or the block itself)."""
    return getattr(module, "_checkpoint_wrapped_module", module)

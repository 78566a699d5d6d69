"""The diffusers transformers knapformer balances: one declaration (`ModelSpec`) each.

Each entry is all the model-specific code its class needs; the lines are counted in
docs/diffusers.md. Stream order is the order the model's attention processor joins
them (text first for Flux, image first for SD3 and HunyuanVideo).
"""

from __future__ import annotations

from knapformer.integrations.diffusers.declarations import JOINT, Blocks, ModelSpec, Tok

_MMDIT = {"hidden_states": "image", "encoder_hidden_states": "text"}
_TEXT_IMAGE = ("encoder_hidden_states", "hidden_states")  # what an MMDiT block returns
_IMAGE_TEXT = ("hidden_states", "encoder_hidden_states")

FLUX = ModelSpec(
    streams=("text", "image"),
    blocks=(Blocks("transformer_blocks", _MMDIT, _TEXT_IMAGE),
            Blocks("single_transformer_blocks", _MMDIT, _TEXT_IMAGE)),
    tokens={"image_rotary_emb": Tok(JOINT)},
)  # fmt: skip

FLUX2 = ModelSpec(
    streams=("text", "image"),
    blocks=(Blocks("transformer_blocks", _MMDIT, _TEXT_IMAGE),
            Blocks("single_transformer_blocks", {"hidden_states": JOINT}, ("hidden_states",))),
    tokens={"image_rotary_emb": Tok(JOINT)},
)  # fmt: skip

QWEN_IMAGE = ModelSpec(
    streams=("text", "image"),
    blocks=(Blocks("transformer_blocks", _MMDIT, _TEXT_IMAGE),),
    tokens={"image_rotary_emb": (Tok("image"), Tok("text"))},
    masks={"encoder_hidden_states_mask": Tok("text", 1)},
)

SD3 = ModelSpec(
    streams=("image", "text"),
    blocks=(Blocks("transformer_blocks", _MMDIT, _TEXT_IMAGE),),
)

WAN = ModelSpec(  # text-to-video and image-to-video: the prompt is each sample's own
    streams=("image",),
    blocks=(Blocks("blocks", {"hidden_states": "image"}, ("hidden_states",)),),
    tokens={"rotary_emb": Tok("image", 1)},
)

HUNYUAN_VIDEO = ModelSpec(
    streams=("image", "text"),
    blocks=(Blocks("transformer_blocks", _MMDIT, _IMAGE_TEXT),
            Blocks("single_transformer_blocks", _MMDIT, _IMAGE_TEXT)),
    tokens={"freqs_cis": Tok("image"), "image_rotary_emb": Tok("image")},
    masks={"attention_mask": Tok(JOINT, -1)},
    ignored=("args",),  # first_frame_num_tokens: read only by image-to-video's token_replace
)  # fmt: skip

LTX_VIDEO = ModelSpec(  # the prompt is each sample's own, for cross-attention
    streams=("image",),
    blocks=(Blocks("transformer_blocks", {"hidden_states": "image"}, ("hidden_states",)),),
    tokens={"image_rotary_emb": Tok("image", 1)},
)

COGVIDEOX = ModelSpec(
    streams=("text", "image"),
    blocks=(Blocks("transformer_blocks", _MMDIT, _IMAGE_TEXT),),
    tokens={"image_rotary_emb": Tok("image")},
    tail="norm_final",
)

#: Declarations by class name.
SPECS: dict[str, ModelSpec] = {
    "FluxTransformer2DModel": FLUX,
    "Flux2Transformer2DModel": FLUX2,
    "QwenImageTransformer2DModel": QWEN_IMAGE,
    "SD3Transformer2DModel": SD3,
    "WanTransformer3DModel": WAN,
    "HunyuanVideoTransformer3DModel": HUNYUAN_VIDEO,
    "LTXVideoTransformer3DModel": LTX_VIDEO,
    "CogVideoXTransformer3DModel": COGVIDEOX,
}

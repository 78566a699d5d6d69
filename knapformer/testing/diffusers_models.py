"""Tiny random diffusers transformers of every supported class, and samples for them, for
the tests and bench/integration.py.

Each entry of `MODELS` builds a model with two blocks per list, a few heads of dimension
8 to 16, and random weights (AdaLN-zero starts at zero: every path must count), and
makes one sample's keyword arguments, ``model(**sample)``, for a size: ``(visual, text)``
where ``visual`` is the model's own geometry (tokens, or frames/height/width of the
latent) and ``text`` the prompt's tokens (``(valid, padded)`` where the model takes a
mask). Sizes are chosen so that samples differ in image and prompt sizes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class TinyModel:
    cls: str  # diffusers class name
    config: dict[str, Any]
    sample: Callable[[torch.Generator, Any], dict[str, Any]]  # (gen, size) -> kwargs
    sizes: tuple[Any, ...]  # sizes a world draws its samples from, big ones first

    def build(self, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
        """The model with seed-0 random weights, rounded to ``dtype``."""
        import diffusers

        torch.manual_seed(0)
        model = getattr(diffusers, self.cls)(**self.config)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.1)
        return model.to(dtype)


def _randn(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen)


def _time(gen: torch.Generator) -> torch.Tensor:
    """A timestep in [0, 1] exact in bf16 through a model's ``timestep * 1000``."""
    return (2.0 ** -torch.randint(0, 5, (1,), generator=gen)).float()


def _grid_ids(h: int, w: int, axes: int = 3) -> torch.Tensor:
    """Flux-style RoPE ids ``(h * w, axes)``: zeros, then row and column."""
    rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    ids = torch.zeros(h * w, axes)
    ids[:, -2], ids[:, -1] = rows.reshape(-1), cols.reshape(-1)
    return ids


def _flux(gen, size):
    (h, w), lt = size
    return dict(hidden_states=_randn(gen, 1, h * w, 8),
                encoder_hidden_states=_randn(gen, 1, lt, 12),
                pooled_projections=_randn(gen, 1, 8), timestep=_time(gen),
                img_ids=_grid_ids(h, w), txt_ids=torch.zeros(lt, 3),
                guidance=_time(gen))  # fmt: skip


def _flux2(gen, size):
    (h, w), lt = size
    txt = torch.zeros(lt, 4)
    txt[:, -1] = torch.arange(lt)
    return dict(hidden_states=_randn(gen, 1, h * w, 8),
                encoder_hidden_states=_randn(gen, 1, lt, 12),
                timestep=_time(gen), img_ids=_grid_ids(h, w, 4), txt_ids=txt,
                guidance=_time(gen))  # fmt: skip


def _qwen(gen, size):
    (h, w), (valid, padded) = size
    mask = torch.zeros(1, padded, dtype=torch.long)
    mask[:, :valid] = 1
    text = _randn(gen, 1, padded, 12) * mask[..., None]  # padding: zeros, as the pipeline's
    return dict(hidden_states=_randn(gen, 1, h * w, 16), encoder_hidden_states=text,
                encoder_hidden_states_mask=mask, timestep=_time(gen),
                img_shapes=[(1, h, w)])  # fmt: skip


def _sd3(gen, size):
    (h, w), lt = size
    return dict(hidden_states=_randn(gen, 1, 4, h, w), encoder_hidden_states=_randn(gen, 1, lt, 12),
                pooled_projections=_randn(gen, 1, 8), timestep=_time(gen) * 1000)  # fmt: skip


def _wan(gen, size):
    (f, h, w), lt = size
    text = torch.zeros(1, 8, 16)
    text[:, :lt] = _randn(gen, 1, lt, 16)  # zero-padded to one length, as the pipeline's
    return dict(hidden_states=_randn(gen, 1, 4, f, h, w), timestep=_time(gen) * 1000,
                encoder_hidden_states=text)  # fmt: skip


def _wan_i2v(gen, size):
    sample = _wan(gen, size)
    text = torch.zeros(1, 512, 16)  # WanAttnProcessor takes the last 512 as the prompt
    text[:, :8] = sample["encoder_hidden_states"][:, :8]
    return {**sample, "encoder_hidden_states": text,
            "encoder_hidden_states_image": _randn(gen, 1, 4, 8)}  # fmt: skip


def _hunyuan(gen, size):
    (f, h, w), (valid, padded) = size
    mask = torch.zeros(1, padded, dtype=torch.long)
    mask[:, :valid] = 1
    return dict(hidden_states=_randn(gen, 1, 4, f, h, w), timestep=_time(gen) * 1000,
                encoder_hidden_states=_randn(gen, 1, padded, 16), encoder_attention_mask=mask,
                pooled_projections=_randn(gen, 1, 8))  # fmt: skip


def _ltx(gen, size):
    (f, h, w), (valid, padded) = size
    mask = torch.zeros(1, padded, dtype=torch.long)
    mask[:, :valid] = 1
    return dict(hidden_states=_randn(gen, 1, f * h * w, 8),
                encoder_hidden_states=_randn(gen, 1, padded, 12),
                timestep=_time(gen) * 1000, encoder_attention_mask=mask, num_frames=f,
                height=h, width=w)  # fmt: skip


def _cogvideox(gen, size):
    from diffusers.models.embeddings import get_3d_rotary_pos_embed

    (f, h, w), lt = size
    cos, sin = get_3d_rotary_pos_embed(16, ((0, 0), (h // 2, w // 2)), (h // 2, w // 2), f)
    return dict(hidden_states=_randn(gen, 1, f, 4, h, w),
                encoder_hidden_states=_randn(gen, 1, lt, 12),
                timestep=_time(gen) * 1000, image_rotary_emb=(cos, sin))  # fmt: skip


_IMAGES = (((6, 8), 20), ((5, 6), 3), ((2, 3), 6), ((4, 4), 2), ((1, 1), 1), ((3, 2), 9))
_PADDED = (((6, 8), (5, 8)), ((5, 6), (3, 8)), ((2, 3), (8, 8)), ((4, 4), (1, 8)),
           ((1, 1), (2, 8)), ((3, 2), (6, 8)))  # fmt: skip
_VIDEOS = (((4, 8, 8), 6), ((2, 4, 6), 2), ((1, 4, 4), 5), ((3, 2, 4), 1), ((1, 2, 2), 3),
           ((2, 2, 2), 4))  # fmt: skip

MODELS: dict[str, TinyModel] = {
    "flux": TinyModel("FluxTransformer2DModel", dict(
        patch_size=1, in_channels=8, num_layers=2, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=4, joint_attention_dim=12, pooled_projection_dim=8,
        axes_dims_rope=(4, 6, 6), guidance_embeds=True), _flux, _IMAGES),
    "flux2": TinyModel("Flux2Transformer2DModel", dict(
        patch_size=1, in_channels=8, num_layers=2, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=4, joint_attention_dim=12, timestep_guidance_channels=16,
        mlp_ratio=2.0, axes_dims_rope=(4, 4, 4, 4)), _flux2, _IMAGES),
    "qwen_image": TinyModel("QwenImageTransformer2DModel", dict(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
        num_attention_heads=4, joint_attention_dim=12, axes_dims_rope=(4, 6, 6)), _qwen, _PADDED),
    "sd3": TinyModel("SD3Transformer2DModel", dict(
        sample_size=16, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8,
        num_attention_heads=4, joint_attention_dim=12, caption_projection_dim=32,
        pooled_projection_dim=8, out_channels=4, pos_embed_max_size=16,
        dual_attention_layers=(0,), qk_norm="rms_norm"),
        _sd3, tuple(((2 * h, 2 * w), t) for (h, w), t in _IMAGES)),
    "wan": TinyModel("WanTransformer3DModel", dict(
        patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=12, in_channels=4,
        out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2,
        cross_attn_norm=True, rope_max_seq_len=32), _wan, _VIDEOS),
    "wan_i2v": TinyModel("WanTransformer3DModel", dict(
        patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=12, in_channels=4,
        out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2,
        cross_attn_norm=True, rope_max_seq_len=32, image_dim=8, added_kv_proj_dim=48),
        _wan_i2v, _VIDEOS),
    "hunyuan_video": TinyModel("HunyuanVideoTransformer3DModel", dict(
        in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=12,
        num_layers=2, num_single_layers=2, num_refiner_layers=1, mlp_ratio=2.0,
        patch_size=2, patch_size_t=1, guidance_embeds=False, text_embed_dim=16,
        pooled_projection_dim=8, rope_axes_dim=(4, 4, 4)),
        _hunyuan, tuple((v, (max(t, 1), 8)) for v, t in _VIDEOS)),
    "ltx_video": TinyModel("LTXVideoTransformer3DModel", dict(
        in_channels=8, out_channels=8, num_attention_heads=4, attention_head_dim=8,
        cross_attention_dim=32, num_layers=2, caption_channels=12),
        _ltx, tuple((v, (max(t, 1), 8)) for v, t in _VIDEOS)),
    "cogvideox": TinyModel("CogVideoXTransformer3DModel", dict(
        num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=4,
        time_embed_dim=8, text_embed_dim=12, num_layers=2, sample_width=8, sample_height=8,
        sample_frames=9, patch_size=2, max_text_seq_length=16,
        use_rotary_positional_embeddings=True),
        _cogvideox, tuple(((f, 2 * max(h // 2, 1), 2 * max(w // 2, 1)), t)
                          for (f, h, w), t in _VIDEOS)),
}  # fmt: skip


def samples_for(name: str, sizes: list[list[Any]], seed: int = 1) -> list[list[dict[str, Any]]]:
    """Per rank, each size's sample of model ``name`` (the same on every process)."""
    gen = torch.Generator().manual_seed(seed)
    tiny = MODELS[name]
    return [[tiny.sample(gen, size) for size in per_rank] for per_rank in sizes]


def cast(sample: dict[str, Any], dtype: torch.dtype, keep: tuple[str, ...] = ("timestep",)):
    """``sample`` with its floating-point tensors in ``dtype`` but those named in ``keep``
    (a timestep in bf16 would move by up to 4 of 1000); tuples of tensors too."""

    def to(name: str, x: Any) -> Any:
        if isinstance(x, tuple):
            return tuple(to(name, y) for y in x)
        if isinstance(x, torch.Tensor) and x.is_floating_point() and name not in keep:
            return x.to(dtype)
        return x

    return {k: to(k, v) for k, v in sample.items()}


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Torch on one thread in the calling thread while inside (restored after): these
    models are small enough that a second thread mostly spins, which doubled a test's
    CPU time on 2 loaded cores, and tripled that of the references run beside workers."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)

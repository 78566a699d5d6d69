"""The diffusers internals the balanced forwards rely on are checked up front, by name."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

from knapformer.errors import KnapformerError
from knapformer.integrations.diffusers import BalancedFlux, BalancedWan, FluxBatch


def _flux():
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1,
                                  num_single_layers=1, attention_head_dim=8,
                                  num_attention_heads=2, joint_attention_dim=4,
                                  pooled_projection_dim=4, axes_dims_rope=(2, 2, 4))  # fmt: skip


def test_a_renamed_internal_fails_naming_it():
    model = _flux()
    del model.single_transformer_blocks[0].norm.linear
    with pytest.raises(KnapformerError, match=r"single_transformer_blocks\[0\]\.norm\.linear"):
        BalancedFlux(model)


def test_a_changed_signature_fails_naming_it(monkeypatch):
    from diffusers import WanTransformer3DModel
    from diffusers.models.transformers.transformer_wan import WanTimeTextImageEmbedding

    model = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2,
                                  attention_head_dim=12, in_channels=4, out_channels=4,
                                  text_dim=8, freq_dim=8, ffn_dim=16, num_layers=1)  # fmt: skip
    BalancedWan(model)  # as installed: fine
    monkeypatch.setattr(WanTimeTextImageEmbedding, "forward", lambda self, t_and_text: None)
    with pytest.raises(KnapformerError, match=r"condition_embedder\.forward"):
        BalancedWan(model)


def test_unbalanced_packed_forward_is_the_model_and_model_calls_are_unchanged():
    torch.manual_seed(0)
    model = _flux()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    gen = torch.Generator().manual_seed(0)
    sizes = [(5, 3), (2, 6)]
    imgs = [torch.randn(i, 4, generator=gen) for i, _ in sizes]
    txts = [torch.randn(t, 4, generator=gen) for _, t in sizes]
    pooled, steps = torch.randn(2, 4, generator=gen), torch.rand(2, generator=gen)
    iids = [torch.randint(0, 5, (i, 3), generator=gen).float() for i, _ in sizes]
    tids = [torch.zeros(t, 3) for _, t in sizes]
    balanced = BalancedFlux(model)  # installs the packed path on every block
    out = balanced(FluxBatch.pack(imgs, txts, pooled, steps, iids, tids))
    for i in range(2):
        ref = model(hidden_states=imgs[i][None], encoder_hidden_states=txts[i][None],
                    pooled_projections=pooled[i : i + 1], timestep=steps[i : i + 1],
                    img_ids=iids[i], txt_ids=tids[i]).sample[0]  # fmt: skip
        rows = slice(sum(n for n, _ in sizes[:i]), sum(n for n, _ in sizes[: i + 1]))
        torch.testing.assert_close(out[rows], ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(KnapformerError, match=r"FluxBatch\.pooled has 1 rows"):
        balanced(FluxBatch.pack(imgs, txts, pooled[:1], steps, iids, tids))

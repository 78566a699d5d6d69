"""The balanced forward in one process: every declared model equals itself run on each
sample alone (no balancer), what is refused is refused by name, and the per-sample
values behave as a batch of one."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

from knapformer.errors import KnapformerError
from knapformer.integrations.diffusers import BalancedFlux, BalancedWan, FluxBatch, balance
from knapformer.integrations.diffusers.layouts import StepLayouts, activated
from knapformer.integrations.diffusers.per_sample import PerSample
from knapformer.testing.diffusers_models import MODELS, one_thread, samples_for


@pytest.fixture(autouse=True)
def _on_one_thread():
    with one_thread():
        yield


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_packed_forward_without_balancer_is_the_model_per_sample(name):
    tiny = MODELS[name]
    model = tiny.build()
    samples = samples_for(name, [list(tiny.sizes[1:])])[0]  # sizes differ, prompts too
    want = [model(**s).sample for s in samples]
    got = balance(model)(samples)
    assert len(got) == len(samples)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and _rel(g, w) < 1e-5
    assert torch.equal(model(**samples[0]).sample, want[0])  # model(...) itself unchanged


def _tiny(name: str, **config):
    import diffusers

    return getattr(diffusers, name)(**config)


def test_an_unsupported_class_is_refused_by_name():
    wan = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
               in_channels=4, out_channels=4, text_dim=8, freq_dim=8, ffn_dim=16,
               num_layers=1)  # fmt: skip
    vace = _tiny("WanVACETransformer3DModel", **wan, vace_layers=[0], vace_in_channels=4)
    with pytest.raises(KnapformerError, match=r"^WanVACETransformer3DModel is not supported"):
        balance(vace)
    with pytest.raises(KnapformerError, match=r"BalancedWan takes a WanTransformer3DModel, "
                                              r"not a WanVACETransformer3DModel"):  # fmt: skip
        BalancedWan(vace)
    sd3 = MODELS["sd3"].build()
    with pytest.raises(KnapformerError, match=r"not a SD3Transformer2DModel"):
        BalancedFlux(sd3)
    balance(sd3)  # but declared for balance()


def test_a_missing_declared_part_is_named():
    model = MODELS["flux"].build()
    del model.single_transformer_blocks
    with pytest.raises(KnapformerError, match=r"FluxTransformer2DModel\.single_transformer_blocks "
                                              r"is missing"):  # fmt: skip
        balance(model)


def test_samples_whose_inputs_differ_in_shape_are_named():
    model = MODELS["wan"].build()
    a, b = samples_for("wan", [list(MODELS["wan"].sizes[:2])])[0]
    b["encoder_hidden_states"] = b["encoder_hidden_states"][:, :5]  # prompts not padded alike
    with pytest.raises(KnapformerError, match=r"sample 1's block inputs differ"):
        balance(model)([a, b])


def test_an_empty_flux_batch_packs_and_joins_every_parameter():
    batch = FluxBatch.pack([], [], torch.zeros(0, 8), torch.zeros(0), [], [])
    assert batch.seq_lens == [] and batch.image.shape[0] == 0
    model = MODELS["flux"].build()
    rows = BalancedFlux(model)(batch)
    assert rows.shape == (0, 8)
    rows.sum().backward()
    blocks = ("transformer_blocks", "single_transformer_blocks")
    assert all(p.grad is not None for n, p in model.named_parameters()
               if not n.startswith(blocks))  # fmt: skip


def _layouts(row_stream, row_sample):
    import numpy as np

    return StepLayouts(("text", "image"), np.asarray(row_stream), np.asarray(row_sample),
                       torch.device("cpu"), None, [])  # fmt: skip


def test_streams_of_equal_rows_get_spares_so_every_layout_count_differs():
    layouts = _layouts([0, 1, 1, 0], [0, 0, 1, 1])  # 2 text rows, 2 image rows
    counts = {lay.streams: n for n, lay in layouts.counts.items()}
    assert len(set(counts.values())) == 3 and min(counts.values()) >= 2
    empty = _layouts([], [])  # a rank holding no token still has rows (spares)
    assert all(n >= 2 for n in empty.counts)


def test_a_per_sample_value_looks_like_a_batch_of_one_and_meets_tokens_per_sample():
    temb = torch.randn(2, 6)  # two samples
    value = PerSample.of(temb)
    assert value.shape == (1, 6) and value.reshape(1, 2, 3).shape == (1, 2, 3)
    _, scale = value.chunk(2, dim=1)
    assert torch.equal(scale.data, temb[:, 3:])
    layouts = _layouts([1, 1, 1, 0, 0], [0, 1, 1, 0, 1])  # image rows 0-2, text rows 3-4
    image_rows = torch.randn(1, 3, 3)
    with activated(layouts):
        out = image_rows * (1 + scale[:, None])  # one row per token, from its sample
    samples = torch.tensor([0, 1, 1])
    assert torch.allclose(out, image_rows * (1 + temb[samples, 3:])[None])
    rows = value.repeat(2, 1)  # axis 0 of the model's view: sample by sample
    assert rows.shape == (2, 6) and torch.equal(rows.data[2:], temb[1:].repeat(2, 1))


MASKS = [("qwen_image", "encoder_hidden_states_mask"), ("hunyuan_video", "encoder_attention_mask")]


@pytest.mark.parametrize(("name", "mask"), MASKS)
def test_padded_prompts_are_masked_and_the_mask_matters(name, mask):
    """The samples' prompts are padded with a mask; the balanced step leaves the padded
    rows out and equals the model given the mask, which differs from the model given
    none (so the tests of every world would see a mask gone wrong)."""
    tiny = MODELS[name]
    model = tiny.build()
    sample = samples_for(name, [[tiny.sizes[3]]])[0][0]  # one valid prompt token of 8
    assert int(sample[mask].sum()) < sample[mask].shape[1]
    want = model(**sample).sample
    unmasked = model(**{**sample, mask: torch.ones_like(sample[mask])}).sample
    assert _rel(unmasked, want) > 1e-3
    assert _rel(balance(model)([sample])[0], want) < 1e-5

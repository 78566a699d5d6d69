"""bf16 at real sizes: per-token use of per-sample rows must not add error as samples
grow (4,096 tokens per sample, a 1024-px image).

Indexing a sample's row per token in bf16 (``x[index]``) sums thousands of bf16 token
gradients one by one in backward; `rows_to_tokens` sums them in fp32 and rounds once, as
the unmodified model's broadcast does (``index_select``'s CPU kernel happens to as well;
nothing promises that of a GPU's atomic adds). A micro-test of that indexing, then one
long sample through Flux (bf16 weights, and fp32 weights under autocast) and Wan, against
the unmodified model: every parameter's gradient within twice the unmodified model's
bf16 error.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from knapformer.runtime.conditioning import rows_to_tokens
from knapformer.testing.diffusers_models import one_thread

TOKENS = 4096  # per sample
FACTOR = 2.0


@pytest.fixture(autouse=True)
def _on_one_thread():
    with one_thread():
        yield


def _err(got: torch.Tensor, truth: torch.Tensor) -> float:
    return float((got.float() - truth).norm() / truth.norm())


def test_rows_to_tokens_sums_in_fp32_at_4096_tokens_per_sample():
    gen = torch.Generator().manual_seed(0)
    samples, width = 2, 64
    rows = torch.randn(samples, width, generator=gen).bfloat16()
    grad = torch.randn(samples * TOKENS, width, generator=gen).bfloat16()
    index = torch.arange(samples).repeat_interleave(TOKENS)
    truth = grad.float().view(samples, TOKENS, width).sum(1)

    def backward(fn) -> torch.Tensor:
        x = rows.clone().requires_grad_()
        fn(x).backward(grad)
        return x.grad

    # The unmodified model broadcasts a sample's row over its tokens.
    broadcast = backward(lambda x: x[:, None, :].expand(samples, TOKENS, width).reshape(-1, width))
    ours = backward(lambda x: rows_to_tokens(x, index))
    indexed = backward(lambda x: x[index])  # what the hand-written adapters did
    assert _err(ours, truth) <= FACTOR * _err(broadcast, truth)
    # ... where bf16 indexing (its backward, index_put with accumulation) sums token by
    # token: 8e-2 here against 1.6e-3; the size is large enough to show it.
    assert _err(indexed, truth) > 10 * _err(broadcast, truth)


def _grads(tiny, sample, dtype, balanced: bool, autocast: bool) -> dict[str, torch.Tensor]:
    from knapformer.integrations.diffusers import balance
    from knapformer.testing.diffusers_models import cast

    model = tiny.build(torch.float32 if autocast else dtype)
    given = sample if autocast else cast(sample, dtype)
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast and dtype == torch.bfloat16):
        out = balance(model)([given])[0] if balanced else model(**given).sample
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
        (out * weights.to(out.dtype)).sum().backward()
    return {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("name", "size", "autocast"), [
    ("flux", ((64, 64), 16), False),
    ("flux", ((64, 64), 16), True),
    ("wan", ((16, 32, 32), 6), False),
])  # fmt: skip
def test_one_long_sample_bf16_within_twice_the_models_error(name, size, autocast):
    pytest.importorskip("diffusers")
    from knapformer.testing.diffusers_models import MODELS

    tiny = MODELS[name]
    # One block per list, and two heads: the cost is attention over 4,096 tokens.
    small = {"num_layers": 1, "num_attention_heads": 2}
    small |= {"num_single_layers": 1} if name == "flux" else {"ffn_dim": 16}
    tiny = dataclasses.replace(tiny, config={**tiny.config, **small})
    sample = tiny.sample(torch.Generator().manual_seed(0), size)
    from knapformer.integrations.diffusers import balance

    assert balance(tiny.build()).seq_lens([sample])[0] >= TOKENS
    truth = _grads(tiny, sample, torch.float32, False, autocast)
    unbalanced = _grads(tiny, sample, torch.bfloat16, False, autocast)
    balanced = _grads(tiny, sample, torch.bfloat16, True, autocast)
    floor = 1e-3 * max(float(g.norm()) for g in truth.values())
    for p, g in truth.items():
        scale = max(float(g.norm()), floor)
        ours = float((balanced[p] - g).norm()) / scale
        theirs = float((unbalanced[p] - g).norm()) / scale
        assert ours <= FACTOR * max(theirs, 2**-9), (
            f"{p}: balanced bf16 {ours:.2e} from fp32, the model's own bf16 {theirs:.2e}"
        )

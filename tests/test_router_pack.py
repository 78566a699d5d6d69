"""One-pass packing: every tensor's rows written straight into their columns of the send
buffer, in send order, and read straight back; the bytes are those of the wire format
(the rows of every tensor side by side), whatever the dtypes, strides and offsets."""

from __future__ import annotations

import math

import pytest
import torch

from knapformer.runtime.router import as_words, pack_rows, unpack_rows

ROWS = 7


def _wire(tensors, rows):
    """The wire format, written the plain way: concatenate every tensor's row bytes."""
    parts = []
    for t in tensors:
        width = math.prod(t.shape[1:])
        flat = torch.empty(rows, width, dtype=t.dtype).copy_(t.reshape(rows, width))
        parts.append(flat.view(torch.uint8))
    return torch.cat(parts, dim=1)


CASES = {
    "bf16 + int64": lambda n: [torch.randn(n, 64).bfloat16(), torch.arange(n) + (1 << 62)],
    "mixed widths": lambda n: [torch.randn(n, 3), torch.rand(n) > 0.5, torch.randn(n, 2, 2).half()],
    "an empty feature": lambda n: [torch.randn(n, 0), torch.randn(n, 4)],
    "offset views": lambda n: [torch.randn(n + 1, 3)[1:], torch.arange(2 * n)[::2]],
    "expanded gradient": lambda n: [torch.tensor(2.5).expand(n, 4)],
}  # fmt: skip


@pytest.mark.parametrize("rows", [0, 1, ROWS])
@pytest.mark.parametrize("name", list(CASES))
def test_pack_and_unpack_in_one_pass_keep_the_wire_format(name, rows):
    torch.manual_seed(rows)
    tensors = CASES[name](rows)
    specs = [(t.dtype, t.shape[1:]) for t in tensors]
    order = torch.randperm(rows)
    inverse = torch.argsort(order)
    wire = _wire(tensors, rows)[order]
    assert torch.equal(pack_rows(tensors, rows, take=order), wire)
    assert torch.equal(pack_rows(tensors, rows, put=inverse), wire)
    for how in ({"take": inverse}, {"put": order}):
        back = unpack_rows(wire, specs, **how)
        for t, b in zip(tensors, back, strict=True):
            assert b.dtype == t.dtype and b.shape == t.shape and torch.equal(b, t), how
            assert b.is_contiguous()


def test_rows_move_as_the_widest_words_their_bytes_allow():
    def word(t):
        return as_words([t.view(torch.uint8).reshape(t.shape[0], -1)])[0].dtype

    assert word(torch.zeros(4, 6, dtype=torch.bfloat16)) == torch.int32  # 12 bytes a row
    assert word(torch.zeros(4, 3072, dtype=torch.bfloat16)) == torch.int64
    assert word(torch.zeros(4, 3, dtype=torch.uint8)) == torch.uint8
    # bf16 rows of 6 bytes beside int64 positions: every column boundary allows 2 bytes
    rows = 5
    wire = pack_rows([torch.zeros(rows, 3, dtype=torch.bfloat16), torch.arange(rows)], rows)
    assert wire.dtype == torch.uint8 and wire.shape == (rows, 14)

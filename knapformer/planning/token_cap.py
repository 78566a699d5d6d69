"""The per-GPU token cap (``max_tokens_per_gpu``) of an exchange between two bags: the
one rule the exchange passes (exchanges.py, coarse.py, refine.py) check a candidate move
or swap by."""

from __future__ import annotations

import numpy as np


def within_token_cap(tokens, size, a, b, shift, max_tokens: int) -> np.ndarray:
    """Whether bags ``a`` and ``b`` (arrays of bag ids, broadcast together) both stay
    within ``max_tokens`` per GPU when ``shift`` tokens move from ``a`` to ``b`` (a swap:
    what leaves ``a`` less what comes back). ``tokens``, ``size``: each bag's tokens and
    GPUs; the most one of a bag's GPUs holds is ceil(tokens / GPUs)."""
    return (np.ceil((tokens[b] + shift) / size[b]) <= max_tokens) & (
        np.ceil((tokens[a] - shift) / size[a]) <= max_tokens
    )

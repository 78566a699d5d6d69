"""Synthetic data mixes (docs/concepts.md): data codes ``gGbBiIfFsS`` and the named mixes.

``gGbBiIfFsS``: G GPUs, each holding B samples of I px with F frames; S=0 keeps F
latent frames, S=1 (video) compresses to max(int(F / 3.4), 1). A latent frame has
floor(I / 16)^2 visual tokens; each GPU's batch scales its visual tokens by one aspect
multiplier drawn from [0.96, 1.04]; each sample adds a text prompt of 0..392 tokens.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from knapformer.contract.limits import (
    MAX_GPUS,
    MAX_SEQ_LENGTH,
    MAX_SEQUENCES,
    abbreviate,
    check_count,
    parse_count,
)
from knapformer.errors import KnapformerError

MIXES = {
    "lowres": "g32b32i256f1s0",
    "mixres": "g16b4i256f1s0,g4b5i512f1s0,g4b5i1024f1s0,g8b1i2048f1s0",
    "joint": (
        "g8b4i256f1s0,g2b5i512f1s0,g2b5i1024f1s0,g4b1i2048f1s0,g1b10i256f4s0,"
        "g3b1i512f4s0,g8b2i256f85s1,g4b1i512f85s1"
    ),
    # Many short text-image samples and two 61,440-token videos (512 px, 60 latent frames).
    "video": "g30b48i256f1s0,g2b1i512f204s1",
    # Sequence-heavy: one GPU in 32 holds 384 tiny text-image samples (64 px: mostly
    # prompt), the others a few images each, plus 2048-px images and short videos.
    "seqheavy": "g1b384i64f1s0,g25b4i256f1s0,g2b1i2048f1s0,g4b1i512f85s1",
}
#: The joint mix's data types squeezed onto 8 GPUs: images of 256..2048 px, keyframes,
#: videos (the 8-GPU sample plans and the demo).
MIXED8 = (
    "g2b4i256f1s0,g1b5i512f1s0,g1b5i1024f1s0,g1b1i2048f1s0,g1b10i256f4s0,g1b1i512f4s0,g1b2i256f85s1"
)
MAX_TEXT_TOKENS = 392
_CODE = re.compile(r"g([0-9]+)b([0-9]+)i([0-9]+)f([0-9]+)s([01])")


@dataclass(frozen=True)
class DataCode:
    gpus: int
    batch: int
    resolution: int
    frames: int
    video: bool

    def __post_init__(self) -> None:
        if min(self.gpus, self.batch, self.resolution, self.frames) <= 0:
            raise KnapformerError(
                f"data code {self} has a zero GPU, batch, resolution or frame count"
            )
        check_count(self.gpus, MAX_GPUS, f"data code {self}: the GPU count")
        check_count(self.gpus * self.batch, MAX_SEQUENCES, f"data code {self}: its sequences")
        check_count(
            self.visual_tokens + MAX_TEXT_TOKENS,
            MAX_SEQ_LENGTH,
            f"data code {self}: the tokens of a sample",
        )

    @classmethod
    def parse(cls, text: str) -> DataCode:
        shown = abbreviate(repr(text))
        match = _CODE.fullmatch(text.strip())
        if match is None:
            raise KnapformerError(
                f"data code {shown} is not of the form gGbBiIfFsS (e.g. 'g8b4i256f1s0')"
            )
        # Digits are bounded before they become ints (a code may hold 5,000 of them).
        g, b, i, f = (
            parse_count(digits, bound, f"data code {shown}: the {what}")
            for digits, bound, what in zip(
                match.groups()[:4],
                (MAX_GPUS, MAX_SEQUENCES, MAX_SEQ_LENGTH, MAX_SEQ_LENGTH),
                ("GPU count", "samples per GPU", "resolution", "frame count"),
                strict=True,
            )
        )
        return cls(g, b, i, f, match.group(5) == "1")

    @property
    def latent_frames(self) -> int:
        return max(int(self.frames / 3.4), 1) if self.video else self.frames

    @property
    def visual_tokens(self) -> int:
        return self.latent_frames * (self.resolution // 16) ** 2

    def __str__(self) -> str:
        return f"g{self.gpus}b{self.batch}i{self.resolution}f{self.frames}s{int(self.video)}"


def parse_mix(text: str) -> list[DataCode]:
    """A mix name (``joint``) or comma-separated data codes. A word that is neither is
    refused with the closest mix name, if one is close (``jiont`` -> ``joint``)."""
    name = text.strip()
    if name in MIXES:
        text = MIXES[name]
    elif "," not in name and _CODE.fullmatch(name) is None and not name.startswith("g"):
        close = difflib.get_close_matches(name, MIXES, n=1, cutoff=0.6)
        raise KnapformerError(
            f"data mix {name!r} is not a mix name ({', '.join(MIXES)}) nor data codes "
            "gGbBiIfFsS (e.g. 'g8b4i256f1s0')" + (f"; did you mean {close[0]!r}?" if close else "")
        )
    codes = [DataCode.parse(part) for part in text.split(",") if part.strip()]
    if not codes:
        raise KnapformerError(f"data mix {abbreviate(repr(text))} holds no data codes")
    shown = abbreviate(repr(text))
    check_count(mix_gpus(codes), MAX_GPUS, f"the GPU count of data mix {shown}")
    check_count(
        sum(c.gpus * c.batch for c in codes), MAX_SEQUENCES, f"the sequences of data mix {shown}"
    )
    return codes


def mix_gpus(codes: Sequence[DataCode]) -> int:
    return sum(c.gpus for c in codes)


def scale_mix(codes: Sequence[DataCode], gpu_factor: int) -> list[DataCode]:
    """The same mix on ``gpu_factor`` times as many GPUs (every code's G multiplied)."""
    return [DataCode(c.gpus * gpu_factor, c.batch, c.resolution, c.frames, c.video) for c in codes]


def sample_lengths(
    codes: Sequence[DataCode], rng: np.random.Generator, length_scale: float = 1.0
) -> list[np.ndarray]:
    """Sequence lengths for one step, one int64 array per GPU (codes' GPUs in order).

    ``length_scale`` shrinks every length (for laptop-sized demos); lengths stay >= 1.
    """
    out = []
    for code in codes:
        aspect = rng.uniform(0.96, 1.04, size=code.gpus)
        text = rng.integers(0, MAX_TEXT_TOKENS + 1, size=(code.gpus, code.batch))
        visual = np.floor(code.visual_tokens * aspect).astype(np.int64)[:, None]
        lengths = visual + text
        if length_scale != 1.0:
            lengths = np.maximum(np.rint(lengths * length_scale), 1).astype(np.int64)
        out.extend(lengths)
    return out

"""Time a DiT block over a range of sequence lengths and fit the workload model to it
(``knapformer calibrate --benchmark``).

The block is `knapformer.local.models.DiTBlock` (pre-norm attention with q/k RMSNorm and
RoPE, then an MLP of ratio 4): the shape the workload model counts, ``24·L·d²`` for the
linear layers and ``4·L²·d`` for attention per forward. Each point is a batch of equal
sequences of one length (about ``tokens`` tokens in all, so short lengths are not timed
on a handful of tokens), forward and backward, after ``warmup`` untimed calls; its time
is the median of ``repeats`` calls, divided by the sequences in the batch. On CUDA the
calls are timed with events, in bf16; on the CPU with the host clock, in fp32. The fit
is `knapformer.tools.calibrate.calibrate_lengths` (the relative least-squares fit of
`knapformer.planning.workload.fit_scale_gamma`).
"""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from knapformer.contract.limits import (
    MAX_BENCH_DIM,
    MAX_BENCH_LENGTHS,
    MAX_BENCH_TOKENS,
    MAX_BENCH_VALUES,
    abbreviate,
    check_count,
    check_option,
    parse_count,
)
from knapformer.errors import KnapformerError, OptionError
from knapformer.local.models import DiTBlock, positions_in_sequences
from knapformer.tools.calibrate import Calibration, calibrate_lengths

# What torch says it tried to allocate: "4294967296 bytes" (CPU), "4.00 GiB" (CUDA).
_ASKED = re.compile(r"tried to allocate ([\d.]+ ?(?:bytes|[KMGTP]i?B))", re.IGNORECASE)
#: FLUX's width and heads (d = 3072, 24 heads of 128).
DEFAULT_DIM, DEFAULT_HEADS = 3072, 24
#: 256 ... 32,768 tokens: from where the linear layers dominate to where attention does.
DEFAULT_LENGTHS = tuple(256 * 2**i for i in range(8))
DEFAULT_TOKENS = 32768


@dataclass(frozen=True)
class BlockPoint:
    """One length's measurement: ``sequences`` sequences of ``length`` tokens per call."""

    length: int
    sequences: int
    ms: float  # median of the repeats, the whole batch
    times_ms: tuple[float, ...] = field(repr=False)

    @property
    def ms_per_sequence(self) -> float:
        return self.ms / self.sequences


@dataclass(frozen=True)
class BlockBenchmark:
    """The points and the fit made of them."""

    token_dim: int
    heads: int
    device: str
    dtype: str
    points: list[BlockPoint]
    calibration: Calibration

    @property
    def source(self) -> str:
        """What the fit was made of, for a report line."""
        return (
            f"{len(self.points)} lengths of a DiT block ({self.heads} heads, {self.dtype}) "
            f"timed on {self.device}"
        )


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def benchmark_block(
    token_dim: int = DEFAULT_DIM,
    heads: int = DEFAULT_HEADS,
    lengths: Sequence[int] = DEFAULT_LENGTHS,
    device: torch.device | str | None = None,
    tokens: int = DEFAULT_TOKENS,
    warmup: int = 2,
    repeats: int = 5,
    on_point: Callable[[BlockPoint], object] | None = None,
) -> BlockBenchmark:
    """Time forward + backward of one ``DiTBlock(token_dim, heads)`` at each length and fit
    k and γ. ``device``: default CUDA when available, else the CPU; ``on_point`` is called
    with each point as it is measured."""
    device = default_device() if device is None else torch.device(device)
    _check(token_dim, heads, lengths, device, tokens, warmup, repeats)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    block = DiTBlock(token_dim, heads, mlp_ratio=4).to(device=device, dtype=dtype)
    points = []
    for length in sorted({int(n) for n in lengths}):
        n = max(1, tokens // length)
        times = time_block(block, [length] * n, token_dim, dtype, device, warmup, repeats)
        points.append(BlockPoint(length, n, statistics.median(times), tuple(times)))
        if on_point is not None:
            on_point(points[-1])
    cal = calibrate_lengths(
        [p.length for p in points], [p.ms_per_sequence for p in points], token_dim
    )
    return BlockBenchmark(
        token_dim, heads, str(device), str(dtype).removeprefix("torch."), points, cal
    )


def _check(token_dim, heads, lengths, device, tokens, warmup, repeats) -> None:
    for name, value in (("token_dim", token_dim), ("heads", heads), ("tokens", tokens)):
        check_option(name, value)
    check_count(token_dim, MAX_BENCH_DIM, "`token_dim` of a benchmarked block")
    if token_dim % heads or (token_dim // heads) % 2:
        raise OptionError(
            f"`token_dim` {token_dim} must split into `heads` {heads} heads of an even size"
        )
    distinct = {int(n) for n in lengths}
    if len(distinct) < 2 or min(distinct) <= 0:
        raise OptionError(
            f"`lengths` {abbreviate(','.join(map(str, lengths)))}: give at least 2 different "
            "positive lengths (a fit of k and γ needs them; attention grows as L², the rest "
            "as L)"
        )
    check_count(len(distinct), MAX_BENCH_LENGTHS, "`lengths`: the count of distinct lengths")
    check_count(max(distinct), MAX_BENCH_TOKENS, "`lengths`: the longest length")
    values = max(tokens, max(distinct)) * token_dim
    if values > MAX_BENCH_VALUES:
        raise OptionError(
            f"a timed batch holds {max(tokens, max(distinct)):,} tokens × `token_dim` "
            f"{token_dim:,} = {values:,} values; at most {MAX_BENCH_VALUES:,} "
            "(knapformer.contract.limits): lower `tokens` or `token_dim`"
        )
    if warmup < 0 or repeats <= 0:
        raise KnapformerError(f"warmup {warmup}, repeats {repeats}: repeats must be positive")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise KnapformerError(f"--device {device}: this torch sees no CUDA GPU")


def time_block(block, seq_lens, d, dtype, device, warmup, repeats) -> list[float]:
    """ms of each of ``repeats`` forward + backward passes of ``block`` over sequences of
    ``seq_lens`` (one packed (sum(seq_lens), d) input), after ``warmup`` untimed ones."""
    x = torch.randn(sum(seq_lens), d, device=device, dtype=dtype, requires_grad=True)
    pos = positions_in_sequences(seq_lens, device)
    grad = torch.randn_like(x)

    def forward_backward() -> None:
        block.zero_grad(set_to_none=True)
        x.grad = None
        block(x, pos, seq_lens).backward(grad)

    return _time_ms(forward_backward, device, warmup, repeats)


def _time_ms(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int):
    """ms of each of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        out = []
        for _ in range(repeats):
            began = time.perf_counter()
            fn()
            out.append((time.perf_counter() - began) * 1e3)
        return out
    events = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize(device)
    return [start.elapsed_time(end) for start, end in events]


def parse_lengths(text: str) -> list[int]:
    """``"256,512,1024"`` -> ``[256, 512, 1024]``; an `OptionError` naming a bad item (each
    read within `MAX_BENCH_TOKENS`, never converting a number longer than that)."""
    items = text.split(",")
    if len(items) > MAX_BENCH_LENGTHS:
        raise OptionError(
            f"`lengths` gives {len(items):,} lengths; at most {MAX_BENCH_LENGTHS} are timed "
            "(knapformer.contract.limits): each is a batch timed 7 times, and a fit of k and "
            "γ needs a handful spread from short to long"
        )
    return [
        parse_count(
            item.strip(),
            MAX_BENCH_TOKENS,
            "`lengths` item",
            low=1,
        )
        for item in items
    ]


def run_benchmark(
    token_dim: int | None,
    heads: int,
    lengths: str,
    device: str | None,
    tokens: int,
    say: Callable[[str], object] = print,
) -> BlockBenchmark:
    """`benchmark_block` from the command line's options, saying each point as it comes."""
    d = DEFAULT_DIM if token_dim is None else token_dim
    if device is not None and device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise KnapformerError(f"--device {device!r}: use cpu or cuda")
    where = default_device() if device is None else torch.device(device)
    sizes = parse_lengths(lengths)
    _check(d, heads, sizes, where, tokens, 0, 1)  # before the first line is said
    say(f"timing a DiT block, d = {d}, {heads} heads, forward + backward, on {where}:")

    def said(p: BlockPoint) -> None:
        spread = (max(p.times_ms) - min(p.times_ms)) / p.ms if p.ms > 0 else 0.0
        say(
            f"  L = {p.length:>6,}: {p.sequences:>4} sequences, {p.ms:10.3f} ms "
            f"({p.ms_per_sequence:.4g} ms per sequence, spread {spread:.0%})"
        )

    try:
        return benchmark_block(d, heads, sizes, where, tokens, on_point=said)
    except (torch.OutOfMemoryError, MemoryError, RuntimeError) as err:
        if not isinstance(err, torch.OutOfMemoryError | MemoryError) and "alloc" not in str(err):
            raise
        raise KnapformerError(_out_of_memory(err, where)) from None


def _out_of_memory(err: BaseException, device: torch.device) -> str:
    """One line for a benchmark that asked more memory than ``device`` has."""
    asked = _ASKED.search(str(err))
    amount = asked.group(1) if asked else ""
    if amount.endswith("bytes"):
        amount = f"{int(float(amount.split()[0])) / 2**30:.1f} GiB"
    tried = f" (it tried to allocate {amount})" if amount else ""
    return (
        f"the benchmark needs more memory than {device} has{tried}: lower --tokens, the "
        "longest of --lengths or --token-dim"
    )

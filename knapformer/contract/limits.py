"""Upper bounds on every size a plan file or a command-line option can ask for.

A 2 KB file or a short flag must not be able to make the toolkit allocate by the value it
names (a topology ``g1n99999999999``, a GPU rank of 10⁹, a sequence of 2⁶² tokens). Every
bound is far above what the product is built for — the planner targets balance groups of
up to 4,096 GPUs, and a 1,024-GPU step holds ~30,000 sequences — and low enough that
whatever it admits fits a workstation's memory and no int64 sum of a plan can overflow
(sequences × tokens ≤ 2⁵⁰). A value beyond a bound is refused with a `KnapformerError`
naming the value, the bound and this module. docs/reliability.md lists them for users.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

from knapformer.errors import OptionError

#: GPUs of one balance group (a plan's ``gpus``, a topology's bags): 4× the planner's
#: 4,096-GPU target. Per-GPU views (the traffic heatmap) aggregate far below this.
MAX_GPUS = 16_384
#: GPU ranks and the integer ids of legacy plans: torch.distributed ranks are C ints.
MAX_RANK = 2**31 - 1
#: Sequences of one plan or one step: ~35× the 30,000 of a 1,024-GPU step.
MAX_SEQUENCES = 2**20
#: Tokens one rank may hold before routing (its ``local_seq_lens`` summed): ~100 GB of
#: bf16 activations at d = 3,072 for the input alone, beyond any GPU. The balancer checks
#: it on the gathered lengths, so every rank refuses a bigger figure alike.
MAX_RANK_TOKENS = 2**24
#: Chunks of one plan (a sequence in a bag of g GPUs has at most g chunks).
MAX_CHUNKS = 2**22
#: Tokens of one sequence (a billion: activations of d = 3,072 in bf16 would be 6.6 TB).
MAX_SEQ_LENGTH = 2**30
#: Hidden size d of the workload model: far above any model (today's largest DiTs use
#: 3,072..8,192), and the workload of the longest sequences stays finite.
MAX_TOKEN_DIM = 2**24
#: |step| of a plan: integers beyond 2⁵³ are not exact in a double, which the
#: dashboard's plotly.js and most JSON readers use for numbers.
MAX_STEP = 2**53 - 1
#: Steps that ``simulate`` and ``suggest`` sample (each one plans every topology).
MAX_SIM_STEPS = 10_000
#: GPUs a replay re-executes: one local OS process each; beyond this a laptop thrashes.
MAX_REPLAY_GPUS = 64
#: Token values a replay holds (the plan's tokens × --dim): its rows are float32/float64
#: copies on every rank, so 2²⁸ values stay within a few GiB.
MAX_REPLAY_VALUES = 2**28
#: Bytes of one JSON record: a line of a JSONL file, or a whole ``.json`` file. The
#: largest plan the bounds above admit serialises to about 200 MB.
MAX_RECORD_BYTES = 512 * 2**20
#: Measured phases of one plan (``measurements.per_rank_ms``): the balancer records 12.
MAX_PHASES = 64
#: Rounds of one step's link probe (`knapformer.contract.probe`), and the bytes it sends
#: each way per exchange (1 GiB: far beyond what a probe needs to saturate a link).
MAX_PROBE_ROUNDS = 64
MAX_PROBE_BYTES = 2**30
#: Characters of one text field (run, solver, topology, planner version, phase name).
MAX_TEXT_CHARS = 1024

# What one JSON record may hold, checked on its bytes before it is parsed (parsing builds
# a Python object per value: 3 bytes of ``{},`` become a 64-byte dict). Derived from the
# bounds above: the largest plan holds 4 numbers per sequence, 5 per chunk and a few per
# GPU; a legacy summary about as many (keyed by id); its containers are a list per GPU
# in at most 8 per-GPU maps. Memory to parse a record is then what the largest plan
# needs, whatever the file holds.
#: Values (numbers, strings, containers) of one JSON record.
MAX_RECORD_VALUES = (
    5 * MAX_SEQUENCES + 6 * MAX_CHUNKS + (9 + MAX_PHASES + MAX_PROBE_ROUNDS) * MAX_GPUS
)
#: Objects and arrays of one JSON record.
MAX_RECORD_CONTAINERS = 8 * MAX_GPUS + 2 * MAX_PHASES + 2 * MAX_PROBE_ROUNDS + 256
#: Nesting of one JSON record: a plan is 4 levels deep (plan, measurements, per_rank_ms,
#: a phase's times), a list of plans one more.
MAX_RECORD_DEPTH = 8

# Measured and learnt figures (floats). Each is refused beyond its bound, and so is any
# non-zero magnitude below `MIN_FIGURE` (subnormals included): such a figure is noise,
# and dividing by it (loads over speeds, ratios to a mean) overflows to inf.
#: The smallest non-zero magnitude of any float figure of a plan.
MIN_FIGURE = 1e-30
#: Workload of one sequence, in model units or calibrated ms: far above the model's value
#: for a `MAX_SEQ_LENGTH` sequence at `MAX_TOKEN_DIM` (~10^14 × scale × γ); 2^20 of them
#: still sum to a finite double.
MAX_WORKLOAD = 1e30
#: A measured time (ms) of one phase on one GPU, and a plan's ``plan_ms``: one day.
MAX_MEASURED_MS = 86_400_000.0
#: Relative speed of a GPU (``gpu_speed``; 1 = nominal). The history cost model keeps its
#: learnt speeds within 1/8..8.
MIN_GPU_SPEED, MAX_GPU_SPEED = 1e-3, 1e3
#: The workload model's attention weight γ and time scale k (``gamma``, ``scale``).
MAX_GAMMA = 1e6
MIN_SCALE, MAX_SCALE = 1e-12, 1e12
#: A plan's ``time`` (unix seconds): the end of year 9999.
MAX_UNIX_TIME = 253_402_300_799.0

# A profiler trace merged into a knapformer trace (`knapformer trace --merge`), one per
# rank. Read one at a time, each parsed whole: its Python objects take ~5x its bytes.
#: Bytes of one profiler trace, a ``.json.gz`` counted as it inflates: a few profiled
#: steps of a large model (torch.profiler writes ~300 bytes per event).
MAX_TRACE_BYTES = 64 * 2**20
#: Objects and arrays, values and nesting of one profiler trace (an event is an object
#: with an ``args`` object; torch.profiler's shapes nest 6 deep).
MAX_TRACE_CONTAINERS = 2**20
MAX_TRACE_VALUES = 2**23
MAX_TRACE_DEPTH = 16
#: |ts| and ``dur`` of a profiler event, µs: the end of year 9999 since the Unix epoch.
MAX_TRACE_US = MAX_UNIX_TIME * 1e6

# The block benchmark (`knapformer calibrate --benchmark`): a batch holds
# max(tokens, length) tokens of width token_dim, with ~20 activations of that size kept
# for the backward pass.
#: Distinct lengths one benchmark times: each is a batch of ``--tokens`` tokens timed 7
#: times (2 warm-up, 5 timed), about a second each on a GPU at FLUX's width, so 64
#: lengths are minutes; a fit of 2 parameters needs a handful.
MAX_BENCH_LENGTHS = 64
#: Tokens of one timed batch, and the longest sequence timed (4x the 2^18 tokens of a
#: 2048 px, 85-frame video's latents).
MAX_BENCH_TOKENS = 2**20
#: Token values (tokens x width) of one timed batch: 4 GiB per fp32 activation, beyond
#: which no GPU holds a block's backward pass.
MAX_BENCH_VALUES = 2**30
#: Width of a benchmarked block: twice the widest DiT's (8,192). Its weights, gradients
#: and optimizer-free backward take ~100·d² bytes in fp32 (27 GB at this bound).
MAX_BENCH_DIM = 16_384
#: Attention heads of a benchmarked block or a replay (DiTs use 24..64).
MAX_HEADS = 4096
#: Transformer layers of a modelled step (`CommModel.layers`; FLUX has 57).
MAX_LAYERS = 1024


@dataclass(frozen=True)
class Bound:
    """The range of one numeric option (or recorded figure of the same meaning)."""

    low: float
    high: float
    whole: bool = False  # a whole number (an int; a float of integral value is refused)
    unit: str = ""  # follows the numbers in a message, e.g. " GB/s"


#: Every numeric option of the command line, by parameter name, and the figures a plan
#: records with the same meaning (its communication model, ``solver_options.comm``): each
#: value is refused outside its range where it is parsed (`check_option`), so that no
#: command overflows, allocates beyond the machine or prints inf. ``knapformer.cli.bounds``
#: applies it to every option named here; a test fails for a numeric option missing.
OPTION_BOUNDS: dict[str, Bound] = {
    # the cluster a step is priced on (knapformer.planning.communication.CommModel)
    "tflops": Bound(1e-3, 1e6, unit=" TFLOP/s"),
    "intra_gbs": Bound(1e-3, 1e6, unit=" GB/s"),
    "inter_gbs": Bound(1e-3, 1e6, unit=" GB/s"),
    "node_size": Bound(1, MAX_GPUS, whole=True, unit=" GPUs"),
    "layers": Bound(1, MAX_LAYERS, whole=True),
    "dtype_bytes": Bound(1, 16, whole=True, unit=" bytes"),
    # the workload model and what is sampled or planned
    "d_model": Bound(1, MAX_TOKEN_DIM, whole=True),
    "token_dim": Bound(1, MAX_TOKEN_DIM, whole=True),
    "gamma": Bound(0, MAX_GAMMA),
    "steps": Bound(1, MAX_SIM_STEPS, whole=True),
    "seed": Bound(0, 2**63 - 1, whole=True),
    "gpus": Bound(1, MAX_GPUS, whole=True),
    "max_bag": Bound(1, MAX_GPUS, whole=True),
    "top": Bound(1, MAX_RANK, whole=True),
    # plans picked from a file, the benchmark and replay
    "step": Bound(-MAX_STEP, MAX_STEP, whole=True),
    "window": Bound(0, MAX_STEP, whole=True),
    "heads": Bound(1, MAX_HEADS, whole=True),
    "tokens": Bound(1, MAX_BENCH_TOKENS, whole=True),
    "dim": Bound(1, MAX_TOKEN_DIM, whole=True),
    "port": Bound(0, 65535, whole=True),
    # the ranks of a job whose dumps are read (flight-recorder)
    "world": Bound(1, MAX_GPUS, whole=True, unit=" ranks"),
    # rows a query prints (knapformer query; 0: all)
    "rows": Bound(0, 10**9, whole=True),
}


def check_option(name: str, value: float | None) -> float | None:
    """``value`` when it lies in ``OPTION_BOUNDS[name]`` (None passes: not given); else
    an `OptionError` naming the option, the value and the range."""
    bound = OPTION_BOUNDS[name]
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise OptionError(f"`{name}` must be a number, got {abbreviate(repr(value))}")
    if not bound.whole:
        problem = figure_problem(value, f"`{name}`", bound.low, bound.high, unit=bound.unit)
        if problem is not None:
            raise OptionError(problem)
        return value
    if not isinstance(value, int):
        raise OptionError(f"`{name}` must be a whole number, got {value!r}")
    if not bound.low <= value <= bound.high:
        raise OptionError(
            f"`{name}` is {abbreviate(f'{value:,}', 32)}{bound.unit}; it must lie in "
            f"{bound.low:,}..{bound.high:,}{bound.unit} (knapformer.contract.limits)"
        )
    return value


_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")


def abbreviate(text: str, width: int = 48) -> str:
    """``text`` cut to about ``width`` characters for a message (a hostile value may be
    megabytes long; the message stays one short line), characters that cannot be printed
    escaped (`printable`)."""
    if len(text) > width:
        text = f"{text[: width - 12]}…({len(text):,} chars)"
    return printable(text)


def printable(text: str) -> str:
    """``text`` with control characters and lone surrogates written as escapes
    (``\\x00``, ``\\ud800``): a message or a line naming them can always be printed, and
    stays one line."""
    if _UNPRINTABLE.search(text) is None:
        return text
    return _UNPRINTABLE.sub(lambda m: ascii(m.group())[1:-1], text)


def text_problem(text: str, what: str) -> str | None:
    """Why ``text`` cannot be a text field of a plan (None when it can): longer than
    `MAX_TEXT_CHARS`, or holding a character no terminal prints (a control character, a
    lone surrogate, which no UTF-8 output can even encode)."""
    if len(text) > MAX_TEXT_CHARS:
        return (
            f"{what} {abbreviate(repr(text))} is longer than {MAX_TEXT_CHARS:,} characters "
            "(knapformer.contract.limits)"
        )
    bad = _UNPRINTABLE.search(text)
    if bad is not None:
        return (
            f"{what} {abbreviate(repr(text))} holds a character that cannot be printed "
            f"(U+{ord(bad.group()):04X} at index {bad.start():,})"
        )
    return None


def figure_problem(
    values: float | np.ndarray,
    what: str,
    low: float,
    high: float,
    zero: bool = True,
    unit: str = "",
) -> str | None:
    """Why a float figure (or the first bad one of an array) is not a number in
    ``low..high`` (None when all are); a non-zero magnitude below `MIN_FIGURE` is refused
    too, and 0 unless ``zero``. ``what`` names the figure for the message, e.g.
    ``"gpu_speed"``; for an array the index is appended. ``unit`` follows numbers (``" ms"``)."""
    arr = np.asarray(values, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        tiny = (arr != 0) & (np.abs(arr) < MIN_FIGURE)
        bad = ~np.isfinite(arr) | (arr < low) | (arr > high) | tiny | ((not zero) & (arr == 0))
    if not bad.any():
        return None
    index = int(np.flatnonzero(bad.reshape(-1))[0])
    value = float(arr.reshape(-1)[index])
    where = f"{what}[{index}]" if arr.ndim else what
    if not math.isfinite(value):
        huge = " (a number beyond ±1.8e308 reads as infinite)" if math.isinf(value) else ""
        return f"{where} is {value}{unit}; it must be a finite number{huge}"
    if low <= value <= high and value != 0:
        return (
            f"{where} is {value:.3g}{unit}: a non-zero figure below {MIN_FIGURE:g} is noise "
            "(knapformer.contract.limits)"
        )
    span = f"{low:g}..{high:g}{unit}" + ("" if zero or low > 0 else ", not 0")
    return f"{where} is {value:.6g}{unit}; it must lie in {span} (knapformer.contract.limits)"


def check_count(value: int, bound: int, what: str, low: int = 0) -> int:
    """``value`` if ``low <= value <= bound``, else an `OptionError` naming both.

    ``what`` names the value for the message, e.g. ``"`gpus`"`` (an option, which the
    command line shows as its flag) or ``"topology 'g1n9'"``.
    """
    if value < low:
        raise OptionError(f"{what} must be at least {low:,}, got {value:,}")
    if value > bound:
        raise OptionError(
            f"{what} is {value:,}; at most {bound:,} is supported (knapformer.contract.limits)"
        )
    return value


def parse_count(digits: str, bound: int, what: str, low: int = 0) -> int:
    """The decimal ``digits`` as an int within ``low..bound``, never converting a
    string longer than the bound's (Python refuses more than 4,300 digits)."""
    if not (digits.isascii() and digits.isdigit()):
        raise OptionError(f"{what} must be a whole number, got {abbreviate(repr(digits))}")
    if len(digits.lstrip("0")) > len(str(bound)):
        raise OptionError(
            f"{what} is {abbreviate(digits, 24)}; at most {bound:,} is supported "
            "(knapformer.contract.limits)"
        )
    return check_count(int(digits), bound, what, low)

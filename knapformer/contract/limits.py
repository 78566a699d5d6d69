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

from knapformer.errors import KnapformerError, OptionError

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


def abbreviate(text: str, width: int = 48) -> str:
    """``text`` cut to about ``width`` characters for a message (a hostile value may be
    megabytes long; the message stays one short line)."""
    if len(text) <= width:
        return text
    return f"{text[: width - 12]}…({len(text):,} chars)"


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
        raise KnapformerError(f"{what} must be a whole number, got {abbreviate(repr(digits))}")
    if len(digits.lstrip("0")) > len(str(bound)):
        raise KnapformerError(
            f"{what} is {abbreviate(digits, 24)}; at most {bound:,} is supported "
            "(knapformer.contract.limits)"
        )
    return check_count(int(digits), bound, what, low)

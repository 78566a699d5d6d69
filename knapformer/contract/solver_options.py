"""What a plan records of its solver's options (``solver_options``): known keys only,
each typed and bounded, so that a plan that validates is one replay can re-plan."""

from __future__ import annotations

import math
from typing import Annotated

from pydantic import AfterValidator, ConfigDict, Field
from typing_extensions import TypedDict

from knapformer.contract.limits import MAX_GPUS, MAX_RANK_TOKENS, OPTION_BOUNDS, check_option


def _like_option(name: str) -> AfterValidator:
    """A recorded figure within the range of the command-line option of the same name
    (`knapformer.contract.limits.OPTION_BOUNDS`), whole when that option is."""

    def check(value: float) -> float:
        if OPTION_BOUNDS[name].whole:
            if not (math.isfinite(value) and value == int(value)):
                raise ValueError(f"{name} must be a whole number, got {value!r}")
            check_option(name, int(value))
        else:
            check_option(name, value)
        return value

    return AfterValidator(check)


class CommFigures(TypedDict, total=False):
    """The cluster figures an auto plan priced communication with (the fields of
    `knapformer.planning.communication.CommModel`), each bounded like the option that
    sets it (``--tflops``, ``--node-size``, ...)."""

    __pydantic_config__ = ConfigDict(extra="forbid")  # type: ignore[misc]

    tflops: Annotated[float, _like_option("tflops")]
    intra_gbs: Annotated[float, _like_option("intra_gbs")]
    inter_gbs: Annotated[float, _like_option("inter_gbs")]
    node_size: Annotated[float, _like_option("node_size")]
    layers: Annotated[float, _like_option("layers")]
    dtype_bytes: Annotated[float, _like_option("dtype_bytes")]


class SolverOptions(TypedDict, total=False):
    """What the solver was asked besides the plan's inputs (a plain dict in the plan).
    Known keys only: a new option is a new typed key here."""

    __pydantic_config__ = ConfigDict(extra="forbid")  # type: ignore[misc]

    #: Tokens a GPU may hold after routing (`plan_routing`'s cap).
    max_tokens_per_gpu: Annotated[int, Field(ge=1, le=MAX_RANK_TOKENS * MAX_GPUS)]
    #: topology "auto": the group sizes it chose from (checked against the plan's bags:
    #: `knapformer.contract.alignment`) and the cluster figures it priced communication with.
    group_sizes: list[Annotated[int, Field(ge=1, le=MAX_GPUS)]]
    comm: CommFigures

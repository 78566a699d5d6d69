"""Every tuning constant of the planner's solvers, in one place (docs/planning.md).

Each bounds how far a pass searches or how much it scores per round, so that a step's
planning time follows its size, not how hard it is. The fixed-topology figures are part
of what makes a fixed plan byte-identical across versions: changing one changes plans.
"""

from __future__ import annotations

# Shared by the fixed and the auto solvers.
EPS = 1e-12  # relative slack of a capacity check
HEAVY_FRACTION = 0.25  # of one GPU's capacity: placed before the bulk "stay home" pass
ONE_BY_ONE = 128  # steps of at most this many sequences are placed one by one
# The shared solve state (bags.py, chunks.py): sorts and chunk tables by the faster path.
RANKED_SORT = 4096  # `stable_argsort` ranks values first (one cheap sort) from this many
PATTERN_SIZES = 64  # bags of at most this many GPUs look their remainder patterns up
# Halvings of `water_room`'s bracket on the pour's water level: 2^-50 of the bracket, below
# a float's resolution of the level.
POUR_BISECTIONS = 50

# The fixed-topology solver (planner.py).
# Further from the lower bound than this fraction, greedy is solved as well and the
# better makespan kept: the result is then never worse than greedy's (which is >= the
# bound) by more than 0.1 % of the bound.
FALLBACK_TOLERANCE = 1e-3
SEARCH_TOLERANCE = 8e-4  # the local search stops this close to the bound (with margin)
SEARCH_PARTNERS = 8  # least-loaded bags tried as exchange partners of the most-loaded one
# A search round scores every (leaving, returning) pair while there are at most this many;
# beyond, only the two candidates nearest the ideal exchange per partner.
DENSE_CELLS = 8192
# A step of more bags than this (one size, no token cap) first levels in wide rounds: every
# bag over the stopping load paired with one of the least loaded, all at once; at most
# WIDE_ROUNDS of them (its work follows the bags', not the rounds of a few bags each).
WIDE_BAGS = 512
WIDE_ROUNDS = 16
# Rows a wide round scores at once: small temporaries, their memory reused (no new pages).
WIDE_BLOCK = 4096
# Sequences per home bag up to which the stay-home pass sorts them as (home, rank) runs
# (`_by_home_heaviest_first`); more, and one sort of unique keys is the faster.
HOME_RUNS = 48
# The one-size placement of a pool of about one sequence per bag: a batch that would place
# fewer than this (bags close in occupancy, sequences staying home) is placed one by one.
SHORT_BATCH = 16
BY_HEAP = 512  # sequences then placed one by one before batches are tried again

# topology="auto" (auto.py and the passes it runs).
TIE = 1e-9  # modelled times this close are equal (then: fewer moved tokens)
# Rounding between a bound (`makespan_floor`, `makespan_ceiling`) and the exact price, and
# more: a candidate is only skipped on a bound that clears it by this margin as well.
FLOOR_MARGIN = 1e-9
SMALL_GPUS = 64  # a *small* step: at most this many GPUs ...
SMALL_SEQUENCES = 512  # ... and sequences: every partition solved, then refined exactly
# Bisections on the per-GPU target of the partition floor and of the mixed partition
# (partitions.py): 2^-40 of the starting bracket, far below any cost's resolution.
BISECTIONS = 40
SLOW = 0.9  # a GPU below this share of its group's fastest is split off (`_isolate_slow`)
POUR = 2048  # a larger pool is poured into the bags' room at once, not one by one
# The fixed solver pours a pool of more than this many, all but this many lightest (which
# the one-by-one placement then lays into the last gaps, so few exchanges are left to do).
POUR_TAIL = 4096
FLOOR_STOP = 1e-4  # the exchange passes stop this close to the partition floor
EXCHANGE_MOVES = 128  # exchanges of `exchange_across`, per mixed partition
EXCHANGE_MOVES_LARGE = 24  # in a large step (where sequences are fine-grained)
EXCHANGE_PARTNERS = 8  # least-loaded bags tried per exchange (every bag in a small step)
EXCHANGE_MEMBERS = 32  # members of a bag scored per exchange (a spread sample beyond)
# A coarse large step (`is_coarse`): few sequences per GPU and many GPUs in the smaller groups.
COARSE_PER_GPU = 8  # sequences per GPU, at most
COARSE_SHARE = 1 / 8  # of the GPUs in groups smaller than the largest, at least
EVEN_ROUNDS = 4  # rounds of `even_classes`, at most ...
# ... and a round starts only while the offers priced so far are fewer than this: its work is
# bounded, not the step's bags times its rounds (joint: 3,000-4,000 offers a round at 1,024
# GPUs, four rounds; 12,000-19,000 at 4,096, where rounds after the second did not lower the
# modelled step: two rounds)
EVEN_OFFERS = 1 << 14
EVEN_TRIES = 4  # distinct costs tried per sequence of a bag outside the band
EVEN_BAND = 6e-4  # the band's width, of the mean per-GPU time
LEVEL_ROUNDS = 6  # rounds of `_level`
LEVEL_DONORS = 32  # most loaded bags that exchange in one round
LEVEL_PARTNERS = 4  # least loaded bags offered to each
LEVEL_MEMBERS = 12  # members of a bag scored (a spread sample beyond)
REFINE_ROUNDS = 12  # GPU-exact refinement rounds of a small step (`refine`)
REFINE_PARTNERS = 8  # least loaded bags whose sequences it tries swapping with
# (candidate, GPU) cells a refinement round scores at most: a round costs the same
# whether a GPU holds 4 sequences or 400 (sampled beyond, `_within_budget`).
REFINE_CELLS = 1 << 14
REFINE_SAMPLE = 4  # members sampled per side at least, however large the step
# The stay-home pass prices its sequences at home by runs of one kind of home bag
# (`Prices.at_home`) where the runs hold at least this many sequences on average; fewer,
# and each one's numbers are looked up by its bag.
HOME_RUN_ROWS = 1024
# `per_gpu_costs` looks only at the sequences that could be the dearest where at most one
# in this many are (a gather of the few); more, and it reads every sequence in place.
DEAR_SHARE = 4

"""The plan contract: what a routing plan is, what it says, and how it is stored.

The lowest layer of the core: the schema and its invariants, the statistics derived from
a plan, plan files (ours and the research code's legacy format), run-folder names, the
size limits and the units every view uses. It imports nothing above it (see
``tests/test_layers.py``), and neither torch nor any reader.
"""

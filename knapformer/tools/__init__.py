"""Offline tools over plans and the planner: replay, simulate, suggest, calibrate, and the
synthetic data mixes they sample. They build on the core (`knapformer.*`); nothing in the
core imports them."""

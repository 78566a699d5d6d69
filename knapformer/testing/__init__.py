"""Helpers shared by the tests and the benchmarks (real process groups, synthesised
measurements, polling, the pure-Python baseline planner). Not part of the public API;
some need the ``dev`` extra.
"""

"""Diagnosis: what recorded measurements say about each rank, and which rank is slow.

Reads plans and their measurements only (no torch): the figures the dashboard, the
report and ``knapformer stragglers`` share.
"""

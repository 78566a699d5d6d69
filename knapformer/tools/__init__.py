"""Offline tools over plans and the planner: replay, simulate, suggest, calibrate and trace.
They build on the core's layers and the local workers; nothing below them imports them."""

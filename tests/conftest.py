"""Shared fixtures: paths of the committed sample plans."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "sample_plans"


@pytest.fixture
def sample_dir() -> Path:
    return SAMPLES


@pytest.fixture
def plan8_path() -> Path:
    """The 8-GPU g1n2+g2n1+g4n1 sample plan (one JSON plan)."""
    return SAMPLES / "mixed8_g1n2+g2n1+g4n1.json"


@pytest.fixture
def steps50_path() -> Path:
    """50 consecutive steps of the joint mix on 32 GPUs (JSONL)."""
    return SAMPLES / "joint32_50steps.jsonl"


@pytest.fixture
def legacy_path() -> Path:
    return SAMPLES / "legacy_mixed8.json"

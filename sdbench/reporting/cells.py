"""The helpers every table and plot shares: a number as a table cell, a cell or a column as floats, a ratio of two
numbers."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd


def fmt(value, pattern: str) -> str:
    """`pattern.format(value)`, or "–" where there is no number to show (None, NaN, ±inf, not a number)."""
    value = number(value)
    return pattern.format(value) if math.isfinite(value) else "–"


def number(value) -> float:
    """A cell as a float, NaN where it holds none (None, text)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def numeric(series: pd.Series) -> np.ndarray:
    """A column as float64, anything unparseable as NaN."""
    return pd.to_numeric(series, errors="coerce").astype("float64").to_numpy()


def ratio(a: float, b: float) -> float:
    """a / b, or NaN where either is not a finite number or b is 0."""
    return a / b if b and math.isfinite(a) and math.isfinite(b) else math.nan

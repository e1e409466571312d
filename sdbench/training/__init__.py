"""Fitting trained heads (the kinds of kinds.py) on the target's own answers: `sdbench train-head`."""

"""Fitting trained heads (EAGLE-3, Medusa-1) on the target's own answers: `sdbench train-head`."""

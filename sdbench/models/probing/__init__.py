"""Probing a loaded model: its forward against the library's own (the fidelity probe), and the verdicts kept."""

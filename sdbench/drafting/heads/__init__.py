"""Trained heads as drafters (EAGLE-1, EAGLE-3, Medusa-1): loading, their forwards, chain drafting."""

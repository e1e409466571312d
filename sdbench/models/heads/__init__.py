"""Trained heads (EAGLE-1, EAGLE-3, Medusa-1): reading them (load.py) and their forwards (eagle.py, medusa.py);
drafting with them is drafting/heads.py."""

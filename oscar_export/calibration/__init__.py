"""Calibration: rotations fitted to a model's activations (fit), cached on demand (cached), the budget search
for the format (budget), the Q/K/V capture they read, the rotations themselves and their files."""

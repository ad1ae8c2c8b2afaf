"""Whether `parity --artifact` can fail, and what activation rounding costs an artifact."""

"""Decode-attention kernels: the OSCAR op against each runtime's own attention, the arithmetic floor, kernel sets, scale dtypes, NEON counts, Triton on a GPU."""

"""Quality of the packed cache against baselines at the same bit budget.

Methods (every quantized one keeps the same fp16 sink and recent windows from the OscarConfig,
so the bit budgets match; each reports the bits per element its format stores). A spec may carry
its own bits: ``oscar-3`` (3-bit K and V), ``oscar-k3v2`` (3-bit K, 2-bit V):

- ``fp16``: plain attention over K/V rounded to fp16 (16 bits per element).
- ``naive``: the OSCAR cache without a rotation (per-token, per-group asymmetric INT).
- ``hadamard``: the OSCAR cache with the data-free Hadamard rotation (QuaRot-style).
- ``kivi``: KIVI: K per channel (one scale/zero per channel per block of ``cluster_dim``
  tokens), V per token (groups of ``cluster_dim`` channels), with its fp16 residual
  (:class:`KiviCache`).
- ``oscar``: the OSCAR cache with rotations from a rotation file, or calibrated on the fly
  (:mod:`oscar_export.calibration.fit`: rotations fitted once, clip ratios searched per bit width) on
  text disjoint from the evaluation text.
- ``online``: rotations estimated from each sequence's first chunk, as ``OscarCache``'s online
  mode does (:class:`OnlineOscarKVCache`).

Text split: the evaluation text (default: the bundled model's ``heldout.txt``) is tokenized
once. Its first ``calibration_tokens + calibration_heldout + 16`` tokens are reserved for
calibration (the 16 absorb re-tokenization at the cut) and never evaluated; every metric reads
only the tokens after them. The reservation holds whether or not calibration runs, so numbers
from runs with and without a rotation file are comparable.

Metrics:

1. Perplexity at each context length: non-overlapping windows of the longest context, each run
   through the model with the method's cache as if fed in chunks (first chunk ``sink + recent``
   tokens, then ``chunk`` tokens), so later chunks read earlier tokens as the cache stores them.
   Perplexity at a shorter context c is that of the windows' first c tokens (for a causal model,
   a window of c tokens).
2. Attention-output relative error per layer on the model's captured post-RoPE Q/K/V:
   prefill all but the last ``decode_tokens`` tokens, then decode those one at a time through the
   cache itself; the decoded outputs are compared with exact fp32 attention.
3. Needle retrieval: per seed, one sequence of ``needle_context`` haystack tokens with a random
   ``needle_tokens`` span of other evaluation text inserted at each depth (fraction of the haystack
   before it), then every needle repeated at the end. Accuracy per depth is the fraction of its
   repeat's tokens after the first ``needle_prefix`` that greedy next-token prediction gets right
   under teacher forcing. ``needle_control_accuracy`` is the fp16 accuracy on the same tokens when
   the haystack does not contain the needles: only accuracy above it is retrieval.

Perplexity and needle sequences run in one forward each (:class:`OnePass`): which positions a chunk
reads from the body depends only on where the chunk starts, and what the body holds for a position
only on that position's K/V (KIVI: its block), so the stored values are those of the chunked run
bit for bit (tests compare them with the caches' own) and the attention differs only in float
summation order.
"""

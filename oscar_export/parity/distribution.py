"""Next-token distributions compared position by position, as quantized runtimes are compared in the field
(llama.cpp's perplexity tool with --kl-divergence): KL divergence of a candidate's distribution from a base's,
top-1 agreement, and the perplexity each gives the text's own next tokens."""

from __future__ import annotations

import numpy as np


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-probabilities in float64 (a 150K-entry vocabulary sums far past float32's 7 digits)."""
    x = np.asarray(logits, np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


class Distributions:
    """One run's next-token log-probabilities at N positions, and the text's token at each ([N])."""

    def __init__(self, logits, targets):
        self.logprobs = np.stack([log_softmax(row) for row in logits]).astype(np.float32)
        self.targets = np.asarray(targets, np.int64)
        if len(self.targets) != len(self.logprobs):
            raise ValueError(f"{len(self.logprobs)} positions of logits for {len(self.targets)} targets")

    def nll(self) -> np.ndarray:
        return -self.logprobs[np.arange(len(self.targets)), self.targets].astype(np.float64)

    def perplexity(self) -> float:
        return float(np.exp(self.nll().mean()))


def kl_divergence(base: Distributions, candidate: Distributions) -> np.ndarray:
    """KL(base || candidate) at each position, in nats."""
    p = base.logprobs.astype(np.float64)
    return np.maximum((np.exp(p) * (p - candidate.logprobs.astype(np.float64))).sum(axis=-1), 0.0)


def compare(base: Distributions, candidate: Distributions) -> dict:
    """How far `candidate` is from `base`: KL mean and tail percentiles, top-1 agreement, perplexity ratio."""
    if len(base.targets) != len(candidate.targets) or not np.array_equal(base.targets, candidate.targets):
        raise ValueError("the two runs scored different tokens: expected the same text, teacher-forced")
    kl = kl_divergence(base, candidate)
    agree = base.logprobs.argmax(-1) == candidate.logprobs.argmax(-1)
    return {"positions": len(kl), "kl_mean": float(kl.mean()), "kl_p99": float(np.percentile(kl, 99)),
            "kl_p999": float(np.percentile(kl, 99.9)), "kl_max": float(kl.max()),
            "top1_agreement": float(agree.mean()), "perplexity": candidate.perplexity(),
            "base_perplexity": base.perplexity(), "perplexity_ratio": candidate.perplexity() / base.perplexity()}

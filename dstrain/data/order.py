"""The order a run reads its samples in: sample k of the stream is a pure function of (key, k), so any step can
be re-created and a resumed run (on any data-parallel size) reads what an uninterrupted one would have.

Epoch e of n samples is a permutation of range(n) keyed by (key, e). Up to `LAZY_ABOVE` samples it is numpy's
(`default_rng([*key, e]).permutation(n)`, what a reference loop can rebuild without dstrain); above, a keyed
Feistel network evaluated one sample at a time. Written by hand because none of our libraries has a
permutation that is computed per element: numpy, torch and Megatron's GPTDataset all materialise the
whole index (8 bytes a sample: 1.8 billion 8k-token samples of a 15T-token corpus would hold 15 GB on
every rank), and the issue asks host memory per rank to stay independent of corpus size.
"""
from __future__ import annotations

import numpy as np

LAZY_ABOVE = 1 << 20  # samples; below, numpy's permutation costs at most 8 MB
_M64 = (1 << 64) - 1
_ROUNDS = 4


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a bijective 64-bit mixer, used as the Feistel round function."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


class FeistelPermutation:
    """A bijection of range(n) keyed by a list of ints: a balanced Feistel network on the smallest 2^(2h) >= n,
    with cycle walking (re-encrypt until the value falls below n; fewer than 4 rounds of that on average)."""

    def __init__(self, n: int, key: list[int]):
        self.n = n
        self.half = max(1, ((max(n - 1, 1)).bit_length() + 1) // 2)
        self.mask = (1 << self.half) - 1
        seeds = np.random.default_rng([abs(int(k)) for k in key]).integers(0, 1 << 63, size=_ROUNDS)
        self.round_keys = [int(s) for s in seeds]

    def _encrypt(self, x: int) -> int:
        left, right = x >> self.half, x & self.mask
        for rk in self.round_keys:
            left, right = right, left ^ (_mix64(right ^ rk) & self.mask)
        return (left << self.half) | right

    def __call__(self, i: int) -> int:
        if not 0 <= i < self.n:
            raise IndexError(f"{i} outside range({self.n})")
        x = self._encrypt(i)
        while x >= self.n:
            x = self._encrypt(x)
        return x


class EpochOrder:
    """order(k): which of n samples is read k-th; each epoch (k // n) its own permutation keyed by (key, epoch)."""

    def __init__(self, n: int, key: list[int]):
        if n < 1:
            raise ValueError("an order over no samples")
        self.n, self.key = n, list(key)
        self._epoch: int | None = None
        self._perm = None

    def epoch_permutation(self, epoch: int):
        if self._epoch != epoch:
            key = [*self.key, epoch]
            if self.n <= LAZY_ABOVE:
                self._perm = np.random.default_rng(key).permutation(self.n)
            else:
                self._perm = FeistelPermutation(self.n, key)
            self._epoch = epoch
        return self._perm

    def __call__(self, k: int) -> int:
        perm = self.epoch_permutation(k // self.n)
        j = k % self.n
        return int(perm[j]) if isinstance(perm, np.ndarray) else perm(j)

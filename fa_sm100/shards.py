"""Split a long GPU run over several device calls: ``K/N`` keeps the items at positions
K - 1 modulo N (a round-robin deal, so that neighbouring items, often of the same cost, spread
over the shards); the N shards together hold every item once.

A lent GPU runs one command for at most 10 minutes. ``pytest --shard K/N`` (tests/conftest.py)
and ``scripts/sm90_memcheck.py --shard K/N`` both deal their work this way.
"""


def parse_shard(text: str):
    """``"K/N"`` -> (K, N) with 1 <= K <= N; anything else raises ValueError naming the form."""
    parts = text.split("/")
    try:
        k, n = (int(p) for p in parts)
    except ValueError:
        raise ValueError(f"--shard {text!r}: expected K/N with integers, e.g. 1/2") from None
    if not 1 <= k <= n:
        raise ValueError(f"--shard {text!r}: needs 1 <= K <= N")
    return k, n


def shard_of(items: list, k: int, n: int):
    """(kept, deselected): the items at positions i with i % n == k - 1, and the others."""
    kept = [item for i, item in enumerate(items) if i % n == k - 1]
    dropped = [item for i, item in enumerate(items) if i % n != k - 1]
    return kept, dropped

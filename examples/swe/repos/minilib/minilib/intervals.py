"""Closed integer intervals given as (start, end) pairs with start <= end."""


def overlaps(a, b):
    """True if the closed intervals ``a`` and ``b`` share at least one point."""
    return a[0] <= b[1] and b[0] <= a[1]


def contains(interval, point):
    """True if ``point`` lies in the closed ``interval``."""
    return interval[0] <= point <= interval[1]


def merge(intervals):
    """Sorted list of disjoint intervals covering the same points (touching intervals are merged)."""
    result = []
    for start, end in sorted(intervals):
        if result and start <= result[-1][1] + 1:
            result[-1] = (result[-1][0], max(result[-1][1], end))
        else:
            result.append((start, end))
    return result


def total_length(intervals):
    """Number of integer points covered by the intervals."""
    return sum(end - start + 1 for start, end in merge(intervals))

"""Descriptive statistics on sequences of numbers."""


def mean(values):
    """Arithmetic mean; raises ValueError on an empty sequence."""
    values = list(values)
    if len(values) == 0:
        raise ValueError("mean of an empty sequence")
    return sum(values) / len(values)


def median(values):
    """Middle value of the sorted values (mean of the two middle ones for an even count)."""
    ordered = sorted(values)
    n = len(ordered)
    if n == 0:
        raise ValueError("median of an empty sequence")
    mid = n // 2
    if n % 2 == 1:
        return ordered[mid]
    return (ordered[mid - 1] + ordered[mid]) / 2


def variance(values, sample=True):
    """Variance; ``sample=True`` divides by n - 1 (needs two values), else by n."""
    values = list(values)
    n = len(values)
    if n < 2 and sample:
        raise ValueError("sample variance needs at least two values")
    m = mean(values)
    total = sum((v - m) ** 2 for v in values)
    return total / (n - 1) if sample else total / n


def clamp(value, low, high):
    """``value`` limited to the closed range [low, high]."""
    if low > high:
        raise ValueError("low must not exceed high")
    if value < low:
        return low
    if value > high:
        return high
    return value

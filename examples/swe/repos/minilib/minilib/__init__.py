"""minilib: small helpers for numbers, text and intervals."""

from .intervals import contains, merge, overlaps, total_length
from .stats import clamp, mean, median, variance
from .text import is_palindrome, slugify, truncate, word_count

__all__ = ["clamp", "contains", "is_palindrome", "mean", "median", "merge", "overlaps", "slugify",
           "total_length", "truncate", "variance", "word_count"]

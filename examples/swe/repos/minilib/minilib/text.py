"""Small text helpers."""

import re


def slugify(text):
    """Lower-case words joined by single dashes: "Hello, World!" -> "hello-world"."""
    words = re.findall(r"[a-z0-9]+", text.lower())
    return "-".join(words)


def truncate(text, width, suffix="..."):
    """``text`` cut to at most ``width`` characters, ending with ``suffix`` when it was cut."""
    if width < len(suffix):
        raise ValueError("width is smaller than the suffix")
    if len(text) <= width:
        return text
    return text[: width - len(suffix)] + suffix


def word_count(text):
    """Number of whitespace-separated words."""
    return len(text.split())


def is_palindrome(text):
    """True if the letters and digits of ``text`` read the same both ways (case ignored)."""
    chars = [c.lower() for c in text if c.isalnum()]
    return chars == chars[::-1]

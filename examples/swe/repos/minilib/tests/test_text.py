import pytest
from minilib.text import is_palindrome, slugify, truncate, word_count


def test_slugify():
    assert slugify("Hello, World!") == "hello-world"
    assert slugify("  AGL  rocks 2 ") == "agl-rocks-2"


def test_truncate_short():
    assert truncate("abc", 5) == "abc"
    assert truncate("abcde", 5) == "abcde"


def test_truncate_long():
    assert truncate("abcdefgh", 6) == "abc..."
    assert len(truncate("abcdefgh", 6)) == 6


def test_truncate_too_narrow():
    with pytest.raises(ValueError):
        truncate("abcdef", 2)


def test_word_count():
    assert word_count("one two  three") == 3
    assert word_count("") == 0


def test_is_palindrome():
    assert is_palindrome("A man, a plan, a canal: Panama")
    assert not is_palindrome("abc")

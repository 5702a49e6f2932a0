from minilib.intervals import contains, merge, overlaps, total_length


def test_overlaps():
    assert overlaps((1, 5), (5, 9))
    assert not overlaps((1, 4), (5, 9))


def test_contains():
    assert contains((1, 5), 1)
    assert contains((1, 5), 5)
    assert not contains((1, 5), 6)


def test_merge_touching_and_overlapping():
    assert merge([(5, 8), (1, 3), (4, 4), (10, 12), (11, 15)]) == [(1, 8), (10, 15)]


def test_merge_disjoint():
    assert merge([(1, 2), (5, 6)]) == [(1, 2), (5, 6)]


def test_total_length():
    assert total_length([(1, 3), (2, 5), (10, 10)]) == 6

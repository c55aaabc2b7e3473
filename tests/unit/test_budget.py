"""Memory budgets as users write them, and what memfit.parse_bytes says about the rest."""

import pytest

import memfit


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("6G", 6 * 2**30),  # a bare letter is binary, as in Slurm's --mem
        ("6 GB", 6 * 10**9),
        ("6GiB", 6 * 2**30),
        ("6gib", 6 * 2**30),
        ("3.5GiB", int(3.5 * 2**30)),
        ("800MB", 800 * 10**6),
        ("1e9", 10**9),
        (12345, 12345),
        (1e9, 10**9),
    ],
)
def test_budgets_read(text, expected):
    assert memfit.parse_bytes(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("0.5", "fraction of a byte"),
        (0.5, "fraction of a byte"),
        ("-1", "must be positive"),
        (-1, "must be positive"),
        (0, "must be positive"),
        (float("inf"), "finite"),
        ("inf", "finite"),
        (float("nan"), "finite"),
        ("6 XB", "cannot read"),
        ("", "cannot read"),
    ],
)
def test_bad_budgets_say_what_to_write(text, message):
    with pytest.raises(ValueError, match=message):
        memfit.parse_bytes(text)

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


def test_parse_bytes():
    assert memfit.parse_bytes("6GB") == 6 * 10**9
    assert memfit.parse_bytes("3.5GiB") == int(3.5 * 2**30)
    assert memfit.parse_bytes("800MB") == 800 * 10**6
    assert memfit.parse_bytes(" 512 kib ") == 512 * 1024
    assert memfit.parse_bytes(12345) == 12345
    for bad in ("6 parsecs", "GB", "-1GB", "", "1.2.3MB"):
        with pytest.raises(ValueError, match="memory budget"):
            memfit.parse_bytes(bad)
    with pytest.raises(TypeError):
        memfit.parse_bytes(True)


def test_parse_bytes_units_and_errors():
    assert memfit.parse_bytes("1") == 1  # no unit: bytes
    assert memfit.parse_bytes("7B") == 7
    assert memfit.parse_bytes("0.5KB") == 10**3 // 2  # KB is a power of 10
    assert memfit.parse_bytes("2tb") == 2 * 10**12  # units in any case
    assert memfit.parse_bytes("1TiB") == 2**40  # KiB/MiB/GiB/TiB are powers of 2
    assert memfit.parse_bytes(".25MiB") == 2**20 // 4
    assert memfit.parse_bytes(1.5e3) == 1500  # numbers are bytes
    with pytest.raises(ValueError, match=r"cannot read the memory budget '6 parsecs'.*'6GB', '6 GiB'"):
        memfit.parse_bytes("6 parsecs")
    for zero in (0, "0GB", 0.0):
        with pytest.raises(ValueError, match="must be positive"):
            memfit.parse_bytes(zero)
    with pytest.raises(TypeError, match="got list"):
        memfit.parse_bytes([6])

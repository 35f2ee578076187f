"""The `layers` selector, including the conservative percent rounding."""

from __future__ import annotations

import pytest

from mxrl.recipe import LayerSelector, parse_layers


def _sel(text, n):
    return sorted(parse_layers(text).indices(n))


@pytest.mark.parametrize(
    ("text", "num_layers", "expected"),
    [
        ("5", 48, [5]),
        ("0-3", 48, [0, 1, 2, 3]),
        ("0-3,10", 48, [0, 1, 2, 3, 10]),
        (" 0 - 1 , 7 ", 48, [0, 1, 7]),
        ("first 2", 48, [0, 1]),
        ("last 2", 48, [46, 47]),
        ("first 10%", 48, [0, 1, 2, 3, 4]),  # 4.8 -> 5
        ("last 15%", 48, list(range(40, 48))),  # 7.2 -> 8: layers 40..47
        ("last 15%", 4, [3]),  # 0.6 -> 1
        ("first 10%", 30, [0, 1, 2]),  # exactly 3: no float 3.0000000000000004 -> 4
        ("last 12.5%", 8, [7]),
        ("last 100%", 4, [0, 1, 2, 3]),
        ("first 0%", 4, []),
        ("first 1, last 15%", 48, [0, *range(40, 48)]),
        ("40-60", 48, list(range(40, 48))),  # beyond the model: nothing extra
        ("last 9", 4, [0, 1, 2, 3]),
        (7, 48, [7]),
    ],
)
def test_layer_selectors(text, num_layers, expected):
    assert _sel(text, num_layers) == expected


def test_last_15_percent_of_48_is_8_layers():
    assert len(parse_layers("last 15%").indices(48)) == 8


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("3-1", "'1-3'"),
        ("last", "cannot parse 'last'"),
        ("middle 2", "cannot parse 'middle 2'"),
        ("last 150%", "more than 100%"),
        ("first 1.5", "whole number"),
        ("", "empty"),
        ("1,,2", "cannot parse ''"),
    ],
)
def test_malformed_layer_selectors(text, needle):
    with pytest.raises(ValueError, match="layers") as err:
        LayerSelector(text)
    assert needle in str(err.value)


@pytest.mark.parametrize("value", [-1, 1.5, True, None, [1, 2]])
def test_layer_selector_types(value):
    with pytest.raises(ValueError, match="layers"):
        parse_layers(value)

"""JavaScript semantics of the port (spec Appendix A, §6.4 ToNumber table, §13.1 formatting)."""

from __future__ import annotations

import math

import pytest

from graders.voice_leading.jsnum import (
    MISSING,
    JSONParseError,
    js_property_order,
    js_round,
    js_trim,
    number_to_string,
    parse_json,
    to_number,
)
from graders.voice_leading.prompt import template_string


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (3.0, 3.0),
        (True, 1.0),
        (False, 0.0),
        (None, 0.0),
        ("3", 3.0),
        (" 3 ", 3.0),
        ("+5", 5.0),
        (".5", 0.5),
        ("5.", 5.0),
        ("1e1", 10.0),
        ("-2.5E-1", -0.25),
        ("", 0.0),
        ("   ", 0.0),
        ("\u00a0\ufeff7\u3000", 7.0),
        ("Infinity", math.inf),
        ("+Infinity", math.inf),
        ("-Infinity", -math.inf),
        ("0x1F", 31.0),
        ("0X1f", 31.0),
        ("0o17", 15.0),
        ("0b101", 5.0),
        ([], 0.0),
        ([7.0], 7.0),
        (["7"], 7.0),
        ([[7.0]], 7.0),
        ([None], 0.0),
        ([[], []], math.nan),  # "," is not a number
        ("0x" + "f" * 300, math.inf),
        (10**400, math.inf),
        (-(10**400), -math.inf),
    ],
)
def test_to_number_table(value, expected):
    got = to_number(value)
    if math.isnan(expected):
        assert math.isnan(got)
    else:
        assert got == expected


@pytest.mark.parametrize(
    "value",
    [
        MISSING, {}, {"a": 1.0}, "1_0", "1,5", "two", "NaN", "inf", "infinity", "-0x5", "0x",
        "\u2460", "\u96f6", "1e", "e1", ".", "+", "0x1g", "\x1c7", "7\x85", "1 2", [True],
        [1.0, 2.0], "Infinity1", "infinity",
    ],
)
def test_to_number_nan(value):
    assert math.isnan(to_number(value))


def test_trim_uses_javascript_whitespace():
    assert js_trim("\ufeff\u00a0 x \u2028\u3000") == "x"
    # Python's strip() would remove these; JavaScript's trim keeps them.
    assert js_trim("\x1cx\x85") == "\x1cx\x85"


@pytest.mark.parametrize(
    ("x", "expected"),
    [
        (2.5, 3.0),
        (-2.5, -2.0),
        (0.5, 1.0),
        (1.5, 2.0),
        (-1.5, -1.0),
        (0.49999999999999994, 0.0),
        (-0.49999999999999994, -0.0),
        (4503599627370497.0, 4503599627370497.0),  # odd value >= 2**52 (floor(x + .5) fails)
        (-4503599627370497.0, -4503599627370497.0),
        (1e300, 1e300),
        (2.4, 2.0),
        (-2.6, -3.0),
    ],
)
def test_math_round(x, expected):
    got = js_round(x)
    assert got == expected
    assert math.copysign(1.0, got) == math.copysign(1.0, expected)


def test_math_round_negative_half_is_negative_zero():
    assert math.copysign(1.0, js_round(-0.5)) == -1.0
    assert math.copysign(1.0, js_round(-0.2)) == -1.0


@pytest.mark.parametrize(
    ("x", "text"),
    [
        (1.0, "1"),
        (0.0, "0"),
        (-0.0, "0"),
        (-3.0, "-3"),
        (1.5, "1.5"),
        (0.1, "0.1"),
        (12345678901234567168.0, "12345678901234567000"),
        (1e21, "1e+21"),
        (1.5e21, "1.5e+21"),
        (1e-7, "1e-7"),
        (1.25e-7, "1.25e-7"),
        (1e-6, "0.000001"),
        (1e16, "10000000000000000"),
        (2.0**53, "9007199254740992"),
        (123456.789, "123456.789"),
        (5e-324, "5e-324"),
        (math.inf, "Infinity"),
        (-math.inf, "-Infinity"),
        (math.nan, "NaN"),
    ],
)
def test_number_to_string(x, text):
    assert number_to_string(x) == text


def test_json_numbers_are_doubles():
    value = parse_json("[12345678901234567891, 1e400, -0, 2.5]")
    assert [to_number(v) for v in value] == [12345678901234567168.0, math.inf, 0.0, 2.5]
    assert to_number(parse_json("[" + "9" * 5000 + "]")[0]) == math.inf  # over Python's int limit


@pytest.mark.parametrize(
    "text",
    ["[NaN]", "[Infinity]", "[-Infinity]", "[1,]", "{'a': 1}", "[1] // c", "", "[01]", "[.5]",
     "[+1]", "\ufeff[1]", "\u00a0[1]", '["a\nb"]', "[1] x"],
)
def test_json_strict(text):
    with pytest.raises(JSONParseError):
        parse_json(text)


def test_json_deep_nesting_does_not_raise_other_errors():
    with pytest.raises(JSONParseError):
        parse_json("[" * 100_000 + "]" * 100_000)


def test_javascript_key_order():
    obj = parse_json('{"b": 1, "7": 2, "a": 3, "0": 4, "07": 5, "-1": 6, "1.0": 7, "4294967295": 8,'
                     ' "4294967294": 9}')
    assert js_property_order(obj) == ["0", "7", "4294967294", "b", "a", "07", "-1", "1.0",
                                      "4294967295"]


def test_keys_beyond_the_int_string_limit_are_ordinary_keys():
    # A key of more than 4300 digits once made int() raise inside js_property_order (issue 11).
    huge, index = "1" * 5000, "4294967294"
    obj = parse_json(f'{{"b": 1, "{huge}": [2], "{index}": 3, "{"9" * 11}": 4, "0": 5}}')
    assert js_property_order(obj) == ["0", index, "b", huge, "9" * 11]


def test_duplicate_keys_last_value_first_position():
    obj = parse_json('{"a": 1, "b": 2, "a": 3}')
    assert list(obj.items()) == [("a", 3), ("b", 2)]


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (MISSING, "undefined"),
        (None, "null"),
        (True, "true"),
        (False, "false"),
        (7, "7"),
        (2**70, "1.1805916207174113e+21"),
        (-0.0, "0"),
        (1.5, "1.5"),
        ("I", "I"),
        ([1, None, [2, MISSING], "x"], "1,,2,,x"),  # Array.prototype.join: null/undefined inside print empty
        ({"a": 1}, "[object Object]"),
    ],
)
def test_template_string_prints_as_a_javascript_template_literal(value, text):
    assert template_string(value) == text

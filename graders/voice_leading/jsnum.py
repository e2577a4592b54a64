"""JavaScript value semantics the reference verifier relies on (spec Appendix A, §6.4, §13.1).

The reference is TypeScript, so a bit-for-bit port has to copy a few JavaScript behaviours that
differ from Python's: which characters ``trim`` removes, ``Number(x)`` coercion, ``Math.round``
(halves toward +inf), the remainder operator (sign of the dividend), ``Number.prototype.toString``
and ``JSON.parse`` (strict literals, every number a double, integer-like keys enumerated first).
JSON values are represented as Python ``None`` / ``bool`` / ``float`` / ``str`` / ``list`` /
``dict``; ``MISSING`` stands for ``undefined`` (an absent property).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Final

# TAB LF VT FF CR SP NBSP OGHAM U+2000..U+200A LS PS NNBSP MMSP IDEOGRAPHIC-SP BOM.
JS_WHITESPACE: Final = (
    "\t\n\x0b\x0c\r \xa0\u1680" + "".join(chr(c) for c in range(0x2000, 0x200B))
    + "\u2028\u2029\u202f\u205f\u3000\ufeff"
)
# A regex character class equal to JavaScript's ``\s`` (Python's ``\s`` differs, Appendix A).
JS_WS_CLASS: Final = "[" + re.escape(JS_WHITESPACE) + "]"


class _Missing:
    """JavaScript ``undefined``: an absent property (distinct from JSON ``null``)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "MISSING"


MISSING: Final = _Missing()

_NAN: Final = float("nan")
_TWO_52: Final = 2.0**52
_INT_EXACT: Final = 1 << 53
_DECIMAL = re.compile(r"[+-]?(?:(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|Infinity)")
_RADIX = re.compile(r"0(?:[xX]([0-9a-fA-F]+)|[oO]([0-7]+)|[bB]([01]+))")


def js_trim(text: str) -> str:
    """``String.prototype.trim``: strip JavaScript whitespace (not U+001C..U+001F/U+0085)."""
    return text.strip(JS_WHITESPACE)


def js_round(x: float) -> float:
    """``Math.round``: nearest integer, halves toward +inf, exact for every double.

    ``x - floor(x)`` is exact for |x| < 2**52 (Sterbenz), except on (-0.5, 0) where it may round
    up to 0.5 at most, which still gives the right answer (-0).
    """
    if not math.isfinite(x) or abs(x) >= _TWO_52:
        return x
    base = math.floor(x)
    result = float(base + 1 if x - base >= 0.5 else base)
    if result == 0.0 and (x < 0 or math.copysign(1.0, x) < 0):
        return -0.0  # Math.round(-0.4) is -0 in JavaScript
    return result


def number_to_string(x: float) -> str:
    """``Number.prototype.toString()``: shortest round-trip digits in JavaScript layout."""
    if not isinstance(x, float):
        x = int_to_number(x) if isinstance(x, int) else float(x)
    if x != x:
        return "NaN"
    if x == 0:
        return "0"  # -0 prints as 0
    if math.isinf(x):
        return "Infinity" if x > 0 else "-Infinity"
    if x.is_integer() and abs(x) < 9007199254740992.0:
        return str(int(x))  # below 2**53 an integer's shortest round-trip form is itself
    sign = "-" if x < 0 else ""
    mantissa, _, exponent = repr(abs(float(x))).partition("e")
    int_part, _, frac_part = mantissa.partition(".")
    all_digits = int_part + frac_part
    point = len(int_part) + (int(exponent) if exponent else 0)
    stripped = all_digits.lstrip("0")
    point -= len(all_digits) - len(stripped)
    digits = stripped.rstrip("0")
    k, n = len(digits), point
    if k <= n <= 21:
        body = digits + "0" * (n - k)
    elif 0 < n <= 21:
        body = digits[:n] + "." + digits[n:]
    elif -6 < n <= 0:
        body = "0." + "0" * (-n) + digits
    else:
        e = n - 1
        exp = ("+" if e >= 0 else "-") + str(abs(e))
        body = (digits if k == 1 else digits[0] + "." + digits[1:]) + "e" + exp
    return sign + body


def string_to_number(text: str) -> float:
    """``Number(string)``: JavaScript StringToNumber (decimal, Infinity, 0x/0o/0b, else NaN)."""
    t = js_trim(text)
    if not t:
        return 0.0
    if _DECIMAL.fullmatch(t):
        return float(t)  # the grammar above excludes Python-only forms (inf, nan, 1_0)
    m = _RADIX.fullmatch(t)
    if m is None:
        return _NAN
    hex_digits, oct_digits, bin_digits = m.groups()
    if hex_digits is not None:
        value = int(hex_digits, 16)
    elif oct_digits is not None:
        value = int(oct_digits, 8)
    else:
        value = int(bin_digits, 2)
    try:
        return float(value)  # correctly rounded, like JavaScript
    except OverflowError:
        return math.inf


def value_to_string(value: Any) -> str:
    """``String(x)`` for JSON values as they appear inside ``Array.prototype.join``."""
    if value is None or value is MISSING:
        return ""  # join() writes null/undefined as the empty string
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, int):
        return number_to_string(int_to_number(value))
    if isinstance(value, float):
        return number_to_string(value)
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return ",".join(value_to_string(v) for v in value)
    return "[object Object]"


def int_to_number(value: int) -> float:
    """The double nearest an integer literal (overflow to +-inf, as JavaScript does)."""
    if -_INT_EXACT < value < _INT_EXACT:
        return float(value)
    try:
        return float(value)  # correctly rounded
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def to_number(value: Any) -> float:
    """``Number(x)`` on a JSON value (§6.4); ``MISSING`` is ``undefined`` -> NaN."""
    if isinstance(value, float):
        return value
    if value is None:
        return 0.0
    if value is True:
        return 1.0
    if value is False:
        return 0.0
    if isinstance(value, int):
        return int_to_number(value)
    if isinstance(value, str):
        return string_to_number(value)
    if isinstance(value, list):
        try:
            return string_to_number(value_to_string(value))
        except RecursionError:  # absurdly deep nesting; JavaScript would still coerce it
            return _NAN
    return _NAN  # objects and undefined


def _is_array_index(key: str) -> bool:
    """A canonical array index: ASCII digits, no leading zero, value below 2**32 - 1."""
    if not key or not key.isascii() or not key.isdigit():
        return False
    if len(key) > 1 and key[0] == "0":
        return False
    # 2**32 - 2 has 10 digits: a longer key is no index, and int() of one over 4300 digits
    # would raise (Python's int-string conversion limit).
    return len(key) <= 10 and int(key) < 4294967295


def js_property_order(obj: dict[str, Any]) -> list[str]:
    """Keys in JavaScript enumeration order: array indices ascending, then insertion order.

    Python's dict already keeps a duplicate key at its first position with the last value, as
    ``JSON.parse`` does, so only the index keys need moving.
    """
    keys = list(obj)
    indices = [k for k in keys if k[:1].isdigit() and _is_array_index(k)]
    if not indices:
        return keys
    indices.sort(key=int)
    return indices + [k for k in keys if not _is_array_index(k)]


class JSONParseError(ValueError):
    """The text is not strict JSON (what ``JSON.parse`` would throw on)."""


def _reject_constant(name: str) -> float:
    raise JSONParseError(f"{name} is not JSON")


# Fast path: the C scanner with int literals kept as Python ints (to_number converts them,
# overflow to inf). Python refuses int literals over 4300 digits with a plain ValueError; the
# slow decoder then reads every number through float(), like JavaScript.
_FAST_DECODER: Final = json.JSONDecoder(parse_constant=_reject_constant)
_SLOW_DECODER: Final = json.JSONDecoder(parse_int=float, parse_constant=_reject_constant)


def parse_json(text: str) -> Any:
    """``JSON.parse``: strict JSON, no NaN/Infinity literals.

    Numbers come back as ``float`` or (integer literals) ``int``; treat both through
    ``to_number``. Objects are plain dicts: use ``js_property_order`` for enumeration order.
    """
    try:
        return _FAST_DECODER.decode(text)
    except json.JSONDecodeError as exc:
        raise JSONParseError(str(exc)) from None
    except RecursionError as exc:
        raise JSONParseError(f"nesting too deep: {exc}") from None
    except ValueError as exc:
        if isinstance(exc, JSONParseError):  # a NaN/Infinity literal
            raise
        # otherwise an integer literal longer than Python's int-string limit: retry below
    try:
        return _SLOW_DECODER.decode(text)
    except (ValueError, RecursionError) as exc:
        raise JSONParseError(str(exc)) from None

"""Checks for values that cross a public boundary: one helper per kind of value.

Every public constructor and call of the package checks its arguments with these, so a bad
value is refused where it enters, with its name in the message, before anything changes. The
checks are type-strict on purpose: ``True`` is not the integer 1 (``bool`` is a subclass of
``int`` in Python, so ``isinstance(True, int)`` holds), ``1.5`` is not a token id, and the
string ``"no"`` is not ``False``.
"""
from __future__ import annotations

import math
from array import array

INT64_MIN, INT64_MAX = -2**63, 2**63 - 1
UINT64_MAX = 2**64 - 1
# torch's CPU generator keeps 32 bits of a seed: s and s + 2**32 (or -1 and 2**32 - 1) draw the
# same numbers, so a seed is refused outside [0, 2**32).
SEED_LIMIT = 2**32


def is_int(value) -> bool:
    """An integer, and not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(name: str, value, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` if it is an integer (not a bool) in ``[minimum, maximum]``, else ``ValueError``."""
    if not is_int(value) or (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        if minimum is not None and maximum is not None:
            bounds = f" in [{minimum}, {maximum}]"
        elif minimum is not None:
            bounds = f" >= {minimum}"
        elif maximum is not None:
            bounds = f" <= {maximum}"
        else:
            bounds = ""
        raise ValueError(f"{name} must be an integer{bounds}, got {value!r}")
    return value


def check_positive_int(name: str, value) -> int:
    """``value`` if it is an integer >= 1 (a count of blocks, tokens, sequences)."""
    return check_int(name, value, minimum=1)


def check_bool(name: str, value) -> bool:
    """``value`` if it is ``True`` or ``False`` (not 0/1, not a string)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def check_real(name: str, value, minimum: float | None = None, maximum: float | None = None, *,
               min_inclusive: bool = True) -> float:
    """``value`` as a float if it is a finite int or float (not a bool) within the bounds."""
    try:   # an int too large for a float (10**400) is no finite number either
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    except OverflowError:
        ok = False
    if ok and minimum is not None:
        ok = value >= minimum if min_inclusive else value > minimum
    if ok and maximum is not None:
        ok = value <= maximum
    if not ok:
        low = "" if minimum is None else f"{'>=' if min_inclusive else '>'} {minimum}"
        high = "" if maximum is None else f"<= {maximum}"
        bounds = " and ".join(b for b in (low, high) if b)
        raise ValueError(f"{name} must be a finite number{' ' + bounds if bounds else ''}, got {value!r}")
    return float(value)


def check_choice(name: str, value, choices: tuple) -> str:
    """``value`` if it is one of ``choices``."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


def check_token_ids(name: str, token_ids, vocab_size: int | None = None) -> list[int]:
    """A list of token ids: integers in ``[0, 2**64)`` (and below ``vocab_size`` when given)."""
    token_ids = list(token_ids)
    # The common case in passes that run in C (a prompt can hold 100k tokens): every item an int
    # exactly (no bool, no float, no numpy scalar), none below 0 or above what an unsigned 64-bit
    # integer holds (``array("Q")`` raises for those) and none past the vocabulary. Otherwise the
    # loop below finds the first bad item and names it.
    if not token_ids or ([*map(type, token_ids)].count(int) == len(token_ids) and _fits_uint64(token_ids)
                         and (vocab_size is None or max(token_ids) < vocab_size)):
        return token_ids
    for i, t in enumerate(token_ids):
        if not is_int(t) or not 0 <= t <= UINT64_MAX or (vocab_size is not None and t >= vocab_size):
            limit = f"[0, {vocab_size})" if vocab_size is not None else ">= 0 and < 2**64"
            raise ValueError(f"{name}[{i}] is {t!r}: token ids must be integers {limit}"
                             + (" (the model's vocabulary)" if vocab_size is not None else ""))
    return token_ids


def _fits_uint64(ints: list[int]) -> bool:
    try:
        array("Q", ints)
    except OverflowError:   # below 0, or above UINT64_MAX
        return False
    return True


def check_cache_salt(value) -> str | None:
    """A request's ``cache_salt`` (chapter 12): ``None`` or a non-empty string."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError(f"cache_salt must be a non-empty str, got {type(value).__name__} {value!r}")
    if not value:
        raise ValueError("cache_salt must be a non-empty str, got '': leave it out for no salt")
    try:
        value.encode("utf-8")     # it is hashed as UTF-8 bytes: refuse lone surrogates now
    except UnicodeEncodeError as e:
        raise ValueError(f"cache_salt must be valid Unicode text, got {value!r}: {e.reason}") from None
    return value

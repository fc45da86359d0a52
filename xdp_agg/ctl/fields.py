"""The fields of a control request, checked one by one: a refusal is a RequestError, whose text
the endpoint answers as "error"."""

from __future__ import annotations


class RequestError(Exception):
    """A request the server refuses; the text goes back to the client as "error"."""


def request_key(req: dict) -> str:
    """The request's job name."""
    key = req.get("job")
    if not isinstance(key, str) or not key or len(key) > 200:
        raise RequestError("'job' must be a non-empty job name (a string of at most 200 chars)")
    return key


def int_field(req: dict, name: str, lo: int, hi: int) -> int:
    """Field `name`, an integer in lo..hi."""
    v = req.get(name)
    if isinstance(v, bool) or not isinstance(v, int):
        raise RequestError(f"{req.get('op')}: field {name!r} must be an integer (got {v!r})")
    if not lo <= v <= hi:
        raise RequestError(f"{req.get('op')}: field {name!r} = {v} is not in {lo}..{hi}")
    return v


def float_field(req: dict, name: str) -> float:
    """Field `name`, a number >= 0."""
    v = req.get(name)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
        raise RequestError(f"{req.get('op')}: field {name!r} must be a number >= 0 (got {v!r})")
    return float(v)


def wire_bits_field(req: dict) -> int:
    """Field "wire_bits", a job's element width (docs/protocol.md 5.6): 32 (the default, when
    absent) or 16."""
    v = req.get("wire_bits")
    if v is None:
        return 32
    if isinstance(v, bool) or v not in (32, 16):
        raise RequestError(
            f"{req.get('op')}: field 'wire_bits' = {v!r} is not an element width: 32 or 16"
        )
    return int(v)

"""The wire's primitives, shared by every service: the one error a decoder may raise, bounded
reprs of untrusted values, packed little-endian arrays, and typed msgspec decoding.

A wire type is a `msgspec.Struct` declared once in its service's message module; decoding is a
typed `msgspec.msgpack.Decoder`, so validation comes from the type. Whatever goes wrong while
decoding (bad msgpack, a wrong type, a value nested 1,000 deep, a failed check in `__post_init__`)
surfaces as `ProtocolError`, naming the field, and nothing else: a service catches that one type
and keeps serving.
"""

from __future__ import annotations

import functools
import re
import reprlib
from typing import Any, Callable, Generic, TypeVar

import msgspec
import numpy as np

ID_DTYPE = np.dtype("<i4")  # token ids and policy versions
LOGPROB_DTYPE = np.dtype("<f4")  # log-probs
MASK_DTYPE = np.dtype("u1")  # 0/1 per token (which tokens the policy sampled)
GROUP_DTYPE = np.dtype("<i8")  # prompt group ids


class ProtocolError(ValueError):
    """A message that cannot be decoded; `field` names the offending part (e.g. `scored[3].reward`)."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


def expect(reply, *types: type):
    """`reply` if it is one of `types`, else `ProtocolError`: a peer that answers with a well-formed
    message of another kind is as malformed as one that sends junk."""
    if not isinstance(reply, types):
        raise ProtocolError("reply", f"expected {' or '.join(t.__name__ for t in types)}, got {type(reply).__name__}")
    return reply


_SHORT = reprlib.Repr()  # (keyword arguments only from Python 3.12)
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother, _SHORT.maxlist, _SHORT.maxdict = 2, 60, 60, 4, 4


def short(v: Any) -> str:
    """A repr of an untrusted value fit for an error message: at most ~80 characters, 2 levels deep."""
    return _SHORT.repr(v)


def refusing(decoder):
    """`decoder`, raising `ProtocolError` and only that on any input: a value nested past the
    recursion limit or of a type no reader expected is a malformed message, not a bug to crash on."""

    @functools.wraps(decoder)
    def wrapper(*args, **kwargs):
        try:
            return decoder(*args, **kwargs)
        except ProtocolError:
            raise
        except msgspec.DecodeError as e:
            raise from_msgspec(e) from None
        except (RecursionError, TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError) as e:
            raise ProtocolError("message", f"cannot be decoded ({type(e).__name__})") from None

    return wrapper


_AT = re.compile(r"^(.*?)(?: - at `\$(.*)`)?$", re.S)


def from_msgspec(e: msgspec.DecodeError, where: str = "message") -> ProtocolError:
    """msgspec's "Expected `int`, got `str` - at `$.items[3].reward`" as ProtocolError("items[3].reward", ...)."""
    m = _AT.match(str(e))
    problem, path = (m.group(1), m.group(2)) if m else (str(e), None)
    field = where + path if path and path.startswith("[") else (path.lstrip(".") if path else where)
    return ProtocolError(field, short(problem) if len(problem) > 200 else problem)


# "Expected `int`, got `str` - at `$.rollout.group_id`", "... - at `key` in `$.scores`"
_AT_FIELD = re.compile(r"^(.*?)(?: - at `(?:key` in `)?\$(.*?)`)?$", re.S)
_MISSING = re.compile(r"^Object missing required field `(.*)`$")


def field_error(e: Exception, where: str) -> ProtocolError:
    """A msgspec validation error as `ProtocolError`, its field spelled `where` + msgspec's path
    (`scored[3]` + `.rollout.versions`), and a type's own `__post_init__` check named as its field."""
    m = _AT_FIELD.match(str(e))
    problem, path = (m.group(1), m.group(2) or "") if m else (str(e), "")
    cause = e.__cause__
    if isinstance(cause, ProtocolError):  # raised by a type's __post_init__
        return ProtocolError(f"{where}{path}.{cause.field}", cause.problem)
    missing = _MISSING.match(problem)
    if missing:
        return ProtocolError(f"{where}{path}.{missing.group(1)}", "missing")
    return ProtocolError(where + path, short(problem) if len(problem) > 200 else problem)


def field_decoder(type_: Any) -> Callable[[Any, str], Any]:
    """`decode(frame, where)` into `type_`, raising only `ProtocolError`, its field under `where`."""
    dec = msgspec.msgpack.Decoder(type_)

    def decode(frame: Any, where: str):
        try:
            return dec.decode(frame)
        except msgspec.ValidationError as e:
            raise field_error(e, where) from None
        except msgspec.DecodeError as e:
            raise ProtocolError(where, f"not valid msgpack ({short(str(e))})") from None
        except RecursionError:  # nested past msgspec's depth limit
            raise ProtocolError(where, "nested too deep") from None

    return decode


T = TypeVar("T")


class TypedDecoder(Generic[T]):
    """A typed msgspec decoder that raises only `ProtocolError` and refuses frames over `max_bytes`."""

    def __init__(self, type_: Any, max_bytes: int, where: str = "message"):
        self._dec = msgspec.msgpack.Decoder(type_)
        self.max_bytes = max_bytes
        self.where = where

    def decode(self, frame: Any) -> T:
        try:
            n = len(frame) if not isinstance(frame, memoryview) else frame.nbytes
        except TypeError:
            raise ProtocolError(self.where, f"expected bytes, got {type(frame).__name__}") from None
        if n > self.max_bytes:
            raise ProtocolError(self.where, f"{n} bytes > limit {self.max_bytes}")
        try:
            return self._dec.decode(frame)
        except msgspec.DecodeError as e:
            raise from_msgspec(e, self.where) from None
        except ProtocolError:
            raise
        except (RecursionError, TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError) as e:
            raise ProtocolError(self.where, f"cannot be decoded ({type(e).__name__}: {short(str(e))})") from None


def pack_array(a: Any, dtype: np.dtype) -> bytes:
    """Token ids / log-probs / versions as packed little-endian bytes (msgpack `bin` on the wire)."""
    if isinstance(a, (bytes, bytearray, memoryview)):
        return bytes(a)
    if hasattr(a, "detach"):  # torch tensor, without importing torch here
        a = a.detach().cpu().numpy()
    return np.ascontiguousarray(a, dtype=dtype).tobytes()

# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Reading a JSON array of token ids straight into an ``array('I')``, without a Python int
per token: the compiled half of ``app.route_decode``.

``scan(raw, limit)`` accepts only the plainest spelling of what the route body's schema
allows (``[`` then unsigned decimal integers below 2**32 separated by commas, then ``]``,
JSON whitespace anywhere between) and answers None for anything else: a float, an
exponent, a sign, a leading zero, more than ``limit`` ids, a value out of range, or any
other byte. None never means "invalid", only "not for this reader": the caller then
decodes the body with the reference decoder, which accepts or refuses it exactly as
before (``3.0`` is an integer to JSON Schema, for one). So on every input this scanner
takes, it yields the ids msgspec would have.
"""

from cpython.array cimport array, clone, resize
from libc.stdint cimport uint32_t, uint64_t

cdef array _TEMPLATE = array("I")

cdef inline bint _space(unsigned char c) noexcept:
    return c == 32 or c == 10 or c == 13 or c == 9


def scan(const unsigned char[::1] raw, Py_ssize_t limit):
    """The ids of a JSON array of plain non-negative integers (see the module docstring)
    as ``array('I')``, or None when the array is not spelled that plainly or holds more
    than ``limit`` ids."""
    cdef Py_ssize_t size = raw.shape[0]
    cdef Py_ssize_t at = 0
    cdef Py_ssize_t count = 0
    cdef Py_ssize_t digits
    cdef uint64_t value
    cdef unsigned char c
    cdef array out
    cdef uint32_t* ids
    if array("I").itemsize != 4:
        return None
    # At most one id per two bytes ("1,"), and never more than the limit plus one (the
    # one that shows the limit passed).
    out = clone(_TEMPLATE, min(size // 2 + 1, limit + 1), False)
    ids = <uint32_t*>out.data.as_voidptr
    if True:  # one block, so the checks below read as the grammar does
        while at < size and _space(raw[at]):
            at += 1
        if at >= size or raw[at] != 91:  # "["
            return None
        at += 1
        while at < size and _space(raw[at]):
            at += 1
        if at < size and raw[at] == 93:  # "]": empty
            at += 1
        else:
            while True:
                if count >= limit or at >= size:
                    return None
                c = raw[at]
                if c < 48 or c > 57:  # not a digit: a sign, a string, null, ...
                    return None
                value = 0
                digits = 0
                while at < size and 48 <= raw[at] <= 57:
                    value = value * 10 + (raw[at] - 48)
                    digits += 1
                    at += 1
                    if digits > 10:
                        return None
                if value > 0xFFFFFFFF or (digits > 1 and c == 48):  # range; leading zero
                    return None
                ids[count] = <uint32_t>value
                count += 1
                while at < size and _space(raw[at]):
                    at += 1
                if at >= size:
                    return None
                c = raw[at]
                at += 1
                if c == 93:  # "]"
                    break
                if c != 44:  # ",": anything else (".", "e") is not this reader's
                    return None
                while at < size and _space(raw[at]):
                    at += 1
        while at < size and _space(raw[at]):
            at += 1
        if at != size:
            return None
    resize(out, count)
    return out

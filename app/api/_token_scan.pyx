# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Reading a route body's JSON array of token ids straight into an ``array('I')``, without
a Python int per token: the compiled half of ``app.api.route_decode``.

``scan(body, raw, limit)`` takes the body and the raw JSON text msgspec found for its
``token_ids`` (a ``msgspec.Raw``, which points into the body). It answers None - "not for
this reader", never "invalid" - unless all of these hold, and then the ids:

- ``raw`` lies inside ``body``, and outside it the body names ``token_ids`` exactly once
  (the key itself) and holds no backslash: no duplicate key, and no key spelled with an
  escape that could hide one (a duplicate would be checked by the reference decoder and
  not here);
- ``raw`` is ``[``, unsigned decimal integers below 2**32 without leading zeros separated
  by commas, ``]``, with JSON whitespace between tokens; at most ``limit`` ids.

On None the caller decodes the body with the reference decoder, which accepts or refuses it
exactly as before (``3.0`` is an integer to JSON Schema, ``-1`` a refusal naming the id).
So on every body this reader takes, it yields the ids msgspec would have.
"""

from cpython.array cimport array, clone
from libc.stdint cimport uint32_t, uint64_t
from libc.string cimport memchr, memcpy

cdef extern from *:
    int __builtin_ctzll(unsigned long long) nogil

cdef extern from "string.h" nogil:
    void* memmem(const void* haystack, size_t haystacklen, const void* needle,
                 size_t needlelen)

cdef array _TEMPLATE = array("I")
# Parsed into first, then copied out at its exact size: sizing the answer by the body's
# bytes would allocate (and fault in) several times what the ids need on every call. Only
# touched with the GIL held, so one per process is safe.
cdef array _scratch = array("I")
cdef uint64_t _ALL = 0xFFFFFFFFFFFFFFFFULL
cdef uint64_t _ONE = 1
# The eight-digit reader loads bytes as one little-endian word; elsewhere, one at a time.
cdef bint _LITTLE_ENDIAN = (<unsigned char*>&_ONE)[0] == 1
cdef const char* _KEY = b"token_ids"
cdef size_t _KEY_BYTES = 9


cdef inline bint _space(unsigned char c) noexcept nogil:
    return c == 32 or c == 10 or c == 13 or c == 9


cdef Py_ssize_t _occurrences(const unsigned char* at, const unsigned char* end) noexcept nogil:
    """How many times the key's name occurs in [at, end)."""
    cdef Py_ssize_t found = 0
    cdef const unsigned char* hit
    while at < end:
        hit = <const unsigned char*>memmem(at, end - at, _KEY, _KEY_BYTES)
        if hit == NULL:
            break
        found += 1
        at = hit + _KEY_BYTES
    return found


cdef inline int _leading_digits(uint64_t chunk) noexcept nogil:
    """How many of the eight bytes of ``chunk`` (the first in its lowest byte) are ASCII
    digits before the first that is not. A byte is a digit iff its high half is 3 and
    adding 6 keeps it 3 (0x30-0x39). Adding 6 to a byte above 0xF9 carries into the next
    byte, but such a byte is no digit, so only bytes after the first non-digit can be
    misread, and they are not counted."""
    cdef uint64_t odd = (((chunk & 0xF0F0F0F0F0F0F0F0ULL) ^ 0x3030303030303030ULL)
                         | (((chunk + 0x0606060606060606ULL) & 0xF0F0F0F0F0F0F0F0ULL)
                            ^ 0x3030303030303030ULL))
    # The high bit of each byte that is not zero (no carry between bytes: 0x7F + 0x7F).
    odd = (((odd & 0x7F7F7F7F7F7F7F7FULL) + 0x7F7F7F7F7F7F7F7FULL) | odd) & 0x8080808080808080ULL
    if odd == 0:
        return 8
    return __builtin_ctzll(odd) >> 3


cdef inline uint64_t _eight_digits(uint64_t digits) noexcept nogil:
    """The number the eight digit values in the bytes of ``digits`` spell, the first (most
    significant) in the lowest byte: pairs, then quads, then all eight, by multiplying."""
    digits = digits * 10 + (digits >> 8)  # each 16-bit lane's low byte: 10 * first + second
    return (((digits & 0x000000FF000000FFULL) * (100 + (1000000ULL << 32))
             + ((digits >> 16) & 0x000000FF000000FFULL) * (1 + (10000ULL << 32))) >> 32)


cdef Py_ssize_t _ids(const unsigned char* p, const unsigned char* end, uint32_t* ids,
                     Py_ssize_t limit, const unsigned char** stop) noexcept nogil:
    """The ids of the array starting at ``p`` (after JSON whitespace) written to ``ids``:
    their count, or -1. With ``stop`` NULL the array must end exactly at ``end`` (trailing
    whitespace aside); otherwise it may end anywhere before ``end`` and ``stop`` is set to
    the byte after its ``]``."""
    cdef Py_ssize_t count = 0
    cdef uint64_t value
    cdef uint64_t chunk
    cdef int n
    cdef const unsigned char* first
    cdef unsigned char c
    while p < end and _space(p[0]):
        p += 1
    if p >= end or p[0] != 91:  # "["
        return -1
    p += 1
    while p < end and _space(p[0]):
        p += 1
    if p < end and p[0] == 93:  # "]": empty
        p += 1
    else:
        while True:
            if count >= limit or p >= end:
                return -1
            first = p
            value = 0
            if _LITTLE_ENDIAN and end - p >= 8:
                # Up to eight digits at once (an id has at most ten); the rest one by one.
                memcpy(&chunk, p, 8)
                n = _leading_digits(chunk)
                if n:
                    chunk = (chunk - 0x3030303030303030ULL) & (_ALL >> (64 - 8 * n))
                    value = _eight_digits(chunk << (64 - 8 * n))
                    p += n
            while p < end and <unsigned char>(p[0] - 48) < 10:
                value = value * 10 + (p[0] - 48)
                p += 1
            # No digit (a sign, a string, null), more than 2**32 allows (checked on the
            # digit count first: 20 digits could wrap), or a leading zero.
            if (p == first or p - first > 10 or value > <uint64_t>4294967295U
                    or (p - first > 1 and first[0] == 48)):
                return -1
            ids[count] = <uint32_t>value
            count += 1
            if p < end and p[0] == 44:  # "," right after the id: the common spelling
                p += 1
                while p < end and _space(p[0]):
                    p += 1
                continue
            while p < end and _space(p[0]):
                p += 1
            if p >= end:
                return -1
            c = p[0]
            p += 1
            if c == 93:  # "]"
                break
            if c != 44:  # anything else ("." or "e" of a float, ...) is not this reader's
                return -1
            while p < end and _space(p[0]):
                p += 1
    if stop != NULL:
        stop[0] = p
        return count
    while p < end and _space(p[0]):
        p += 1
    return count if p == end else -1


cdef object _read_ids(const unsigned char* p, const unsigned char* end, Py_ssize_t limit,
                      const unsigned char** stop):
    """``_ids`` of [p, end) as a fresh ``array('I')``, or None. The ids are read into the
    shared scratch array (grown to what [p, end) could hold, at most ``limit + 1``) and
    copied out at their count."""
    global _scratch
    cdef Py_ssize_t most = min((end - p) // 2 + 1, limit + 1)  # an id takes two bytes ("1,")
    cdef Py_ssize_t count
    cdef array out
    if len(_scratch) < most:
        _scratch = clone(_TEMPLATE, most, False)
    count = _ids(p, end, <uint32_t*>_scratch.data.as_voidptr, limit, stop)
    if count < 0:
        return None
    out = clone(_TEMPLATE, count, False)
    memcpy(out.data.as_voidptr, _scratch.data.as_voidptr, count * 4)
    return out


def scan(const unsigned char[::1] body, const unsigned char[::1] raw, Py_ssize_t limit):
    """The ids of ``raw`` (the body's ``token_ids`` text) as ``array('I')``, or None (see
    the module docstring)."""
    cdef Py_ssize_t size = raw.shape[0]
    cdef Py_ssize_t body_size = body.shape[0]
    cdef const unsigned char* start
    cdef const unsigned char* stop
    cdef const unsigned char* whole
    if size == 0 or body_size == 0 or _TEMPLATE.ob_descr.itemsize != 4:
        return None
    whole = &body[0]
    start = &raw[0]
    stop = start + size
    if start < whole or stop > whole + body_size:
        return None
    if (memchr(whole, 92, start - whole) != NULL  # "\\"
            or memchr(stop, 92, whole + body_size - stop) != NULL
            or _occurrences(whole, start) != 1 or _occurrences(stop, whole + body_size)):
        return None
    return _read_ids(start, stop, limit, NULL)


def scan_key(const unsigned char[::1] body, Py_ssize_t limit):
    """``(ids, start, stop)``: the ids of the array that follows the body's only
    ``"token_ids":`` and the bytes it spans, ``body[start:stop]``; or None. Taken only when
    the body holds no backslash at all and spells ``token_ids`` exactly once, right inside
    double quotes and followed (JSON whitespace aside) by a colon and ``[``; the array's ids
    must be as ``scan`` takes them.

    Whether that spelling is the top-level key is not decided here: the caller decodes the
    body with the span replaced by ``null`` and asks ``decoded_at`` whether the top-level
    ``token_ids`` is exactly that ``null``. Only then are these ids the body's."""
    cdef Py_ssize_t size = body.shape[0]
    cdef const unsigned char* whole
    cdef const unsigned char* end
    cdef const unsigned char* key
    cdef const unsigned char* p
    cdef const unsigned char* stop = NULL
    cdef object out
    if size == 0 or _TEMPLATE.ob_descr.itemsize != 4:
        return None
    whole = &body[0]
    end = whole + size
    if memchr(whole, 92, size) != NULL:  # "\\"
        return None
    key = <const unsigned char*>memmem(whole, size, _KEY, _KEY_BYTES)
    if (key == NULL or key == whole or key[-1] != 34 or key + _KEY_BYTES >= end
            or key[_KEY_BYTES] != 34 or _occurrences(key + _KEY_BYTES, end)):
        return None
    p = key + _KEY_BYTES + 1
    while p < end and _space(p[0]):
        p += 1
    if p >= end or p[0] != 58:  # ":"
        return None
    p += 1
    while p < end and _space(p[0]):
        p += 1
    if p >= end or p[0] != 91:  # "["
        return None
    out = _read_ids(p, end, limit, &stop)
    return None if out is None else (out, p - whole, stop - whole)


def decoded_at(const unsigned char[::1] buffer, const unsigned char[::1] raw,
               Py_ssize_t start):
    """Whether ``raw`` (a ``msgspec.Raw`` decoded from ``buffer``) is exactly the four bytes
    ``null`` at ``buffer[start:start + 4]``: the same memory, not an equal copy."""
    return (raw.shape[0] == 4 and 0 <= start and start + 4 <= buffer.shape[0]
            and &raw[0] == &buffer[start])

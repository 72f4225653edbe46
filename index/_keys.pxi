# Included by _fast.pyx: content keys made in C, byte for byte ``index.keys``' keys.
#
# A key is ``xxh3_128_digest(parent key || block tokens)`` from the ``xxhash`` package. In C
# it is made with xxHash's own header (Debian's libxxhash-dev, inlined: XXH_INLINE_ALL, no
# library to link), and kept at import only if it gives the same bytes as
# ``xxh3_128_digest`` on sample inputs of every length class. Built without the header, or
# if the check fails, ``_key_into`` calls the package's Python function instead: slower,
# never different. A node's parent fingerprint is bits of the parent key itself
# (``prefix_index._fingerprint_bits``).

from cpython.bytes cimport PyBytes_FromStringAndSize
from libc.stddef cimport size_t

cdef extern from "Python.h":
    ctypedef Py_ssize_t Py_hash_t

cdef extern from *:
    """
    typedef struct { unsigned long long low64; unsigned long long high64; } kvroute_xxh128;
    typedef kvroute_xxh128 (*kvroute_xxh3_128_fn)(const void*, size_t);
    #define kvroute_bswap64(x) __builtin_bswap64(x)
    #define kvroute_prefetch(p) __builtin_prefetch(p)
    #if defined(__has_include)
    #  if __has_include(<xxhash.h>)
    #    define XXH_INLINE_ALL
    #    include <xxhash.h>
    #    define KVROUTE_XXH3 1
    #  endif
    #endif
    #ifdef KVROUTE_XXH3
    static kvroute_xxh128 kvroute_xxh3_128(const void* data, size_t length) {
        XXH128_hash_t h = XXH3_128bits(data, length);
        kvroute_xxh128 out = {h.low64, h.high64};
        return out;
    }
    #define KVROUTE_XXH3_FN kvroute_xxh3_128
    #else
    #define KVROUTE_XXH3_FN NULL
    #endif
    """
    ctypedef struct kvroute_xxh128:
        uint64_t low64
        uint64_t high64
    ctypedef kvroute_xxh128 (*kvroute_xxh3_128_fn)(const void*, size_t) noexcept nogil
    uint64_t kvroute_bswap64(uint64_t x) noexcept nogil
    void kvroute_prefetch(const void* p) noexcept nogil
    kvroute_xxh3_128_fn KVROUTE_XXH3_FN

cdef kvroute_xxh3_128_fn _xxh3_128 = NULL


cdef inline void _canonical(uint64_t* out, kvroute_xxh128 h) noexcept nogil:
    """The digest's bytes (high half big-endian, then low half) as two words in memory."""
    out[0] = kvroute_bswap64(h.high64)
    out[1] = kvroute_bswap64(h.low64)


cdef int _key_into(uint64_t* out, const uint64_t* parent, const char* block,
                   Py_ssize_t step, bytearray scratch) except -1:
    """out := the key of ``block`` (``step`` bytes of tokens) under the key ``parent``;
    ``scratch`` holds at least 16 + step bytes."""
    cdef char* data = PyByteArray_AS_STRING(scratch)
    memcpy(data, parent, 16)
    memcpy(data + 16, block, step)
    if _xxh3_128 is not NULL:
        _canonical(out, _xxh3_128(data, 16 + step))
    else:
        memcpy(out, PyBytes_AS_STRING(xxh3_128_digest(scratch[:16 + step])), 16)
    return 0


cdef inline Py_hash_t _fingerprint_hash(const uint64_t* key) noexcept nogil:
    """``prefix_index._fingerprint_bits``' bits before the mask: the key's first four bytes,
    little-endian, on any machine."""
    cdef const unsigned char* b = <const unsigned char*>key
    return <Py_hash_t>(<uint64_t>b[0] | (<uint64_t>b[1] << 8) | (<uint64_t>b[2] << 16)
                       | (<uint64_t>b[3] << 24))


cdef inline bytes _key_bytes(const uint64_t* key):
    return PyBytes_FromStringAndSize(<const char*>key, 16)


def _bind_c_hashing():
    """Take xxHash's XXH3_128bits as built, if it was, and check it against the package."""
    global _xxh3_128
    import random

    cdef uint64_t out[2]
    cdef kvroute_xxh3_128_fn found = KVROUTE_XXH3_FN
    cdef bytes sample
    rng = random.Random(0)
    samples = [rng.randbytes(n) for n in (0, 1, 3, 4, 8, 9, 16, 17, 80, 128, 129, 240, 241,
                                          1000, 4112)]
    if found is not NULL:
        for sample in samples:
            _canonical(out, found(<const char*>sample, len(sample)))
            if _key_bytes(out) != xxh3_128_digest(sample):
                found = NULL
                break
    _xxh3_128 = found


def c_hashing(on=None):
    """Whether keys are made in C; ``on`` (tests) turns that off, or back on when the
    import-time check passed. Either way the keys are the same bytes."""
    global _xxh3_128
    if on is not None:
        if on:
            _bind_c_hashing()
        else:
            _xxh3_128 = NULL
    return _xxh3_128 is not NULL


_bind_c_hashing()

# Included by _fast.pyx: content keys made in C, byte for byte ``index.keys``' keys.
#
# A key is ``xxh3_128_digest(parent key || block tokens)`` from the ``xxhash`` package. The
# package's extension module carries the xxHash library and exports its functions; at import
# this module looks ``XXH3_128bits`` up in it (dlsym) and keeps it only if it gives the same
# bytes as ``xxh3_128_digest`` on sample inputs of every length class, and if CPython's
# ``_Py_HashBytes`` gives ``hash(bytes)`` (a node's parent fingerprint is that hash). If
# either check fails (another xxhash build, another interpreter), ``_key_into`` calls the
# Python function instead: slower, never different.

from cpython.bytes cimport PyBytes_FromStringAndSize
from libc.stddef cimport size_t

cdef extern from "<dlfcn.h>" nogil:
    void* dlopen(const char* filename, int flags)
    void* dlsym(void* handle, const char* symbol)
    int RTLD_NOW
    int RTLD_NOLOAD

cdef extern from "Python.h":
    ctypedef Py_ssize_t Py_hash_t
    Py_hash_t _Py_HashBytes(const void* data, Py_ssize_t length)

cdef extern from *:
    """
    typedef struct { unsigned long long low64; unsigned long long high64; } kvroute_xxh128;
    typedef kvroute_xxh128 (*kvroute_xxh3_128_fn)(const void*, size_t);
    #define kvroute_bswap64(x) __builtin_bswap64(x)
    #define kvroute_prefetch(p) __builtin_prefetch(p)
    """
    ctypedef struct kvroute_xxh128:
        uint64_t low64
        uint64_t high64
    ctypedef kvroute_xxh128 (*kvroute_xxh3_128_fn)(const void*, size_t) noexcept nogil
    uint64_t kvroute_bswap64(uint64_t x) noexcept nogil
    void kvroute_prefetch(const void* p) noexcept nogil

cdef kvroute_xxh3_128_fn _xxh3_128 = NULL
cdef bint _c_fingerprints = False


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


cdef inline Py_hash_t _fingerprint_hash(const uint64_t* key) except? -1:
    """``hash(key bytes)``, without making the bytes when CPython's function checked out."""
    if _c_fingerprints:
        return _Py_HashBytes(key, 16)
    return hash(PyBytes_FromStringAndSize(<const char*>key, 16))


cdef inline bytes _key_bytes(const uint64_t* key):
    return PyBytes_FromStringAndSize(<const char*>key, 16)


def _bind_c_hashing():
    """Look XXH3_128bits up in the xxhash extension and check it, and _Py_HashBytes."""
    global _xxh3_128, _c_fingerprints
    import random

    import xxhash._xxhash as xxhash_module
    cdef uint64_t out[2]
    cdef kvroute_xxh3_128_fn found = NULL
    cdef bytes sample
    path = xxhash_module.__file__.encode()
    cdef void* handle = dlopen(path, RTLD_NOW | RTLD_NOLOAD)
    if handle is not NULL:
        found = <kvroute_xxh3_128_fn>dlsym(handle, b"XXH3_128bits")
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
    checked = True
    for sample in samples:
        if _Py_HashBytes(<const char*>sample, len(sample)) != hash(sample):
            checked = False
    _c_fingerprints = checked


def c_hashing(on=None):
    """Whether keys and fingerprints are made in C; ``on`` (tests) turns that off, or back
    on when the import-time checks passed. Either way the keys are the same bytes."""
    global _xxh3_128, _c_fingerprints
    if on is not None:
        if on:
            _bind_c_hashing()
        else:
            _xxh3_128 = NULL
            _c_fingerprints = False
    return _xxh3_128 is not NULL and _c_fingerprints


_bind_c_hashing()

# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Compiled loops of the prefix index: the same work as the pure-Python loops of
``index.prefix_index`` on the same containers, without the interpreter's cost per block.

Every function here takes the index's own dicts and Python ints (node values, holder bits)
and changes them exactly as the pure loop it replaces would, operation for operation and
in the same order; anything off the common path is handed back to ``PrefixIndex``'s own
methods mid-loop, so the layout invariants (``PrefixIndex._check``) are the pure path's.
``KVROUTE_PURE_INDEX=1`` selects the pure loops, which stay the reference: the tests run
both and check they agree on random event streams.

What the compiled loops save: per block, a content key is ``xxh3_128(parent key || block
tokens)``; the pure loop builds a 1-tuple, a block and a concatenation per block, while this
one copies both into one reused buffer, and calls the dict C API instead of bound methods.
Hashing stays ``xxhash``'s own function, so keys are byte for byte those of the pure path.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_FromStringAndSize
from cpython.dict cimport PyDict_GetItem, PyDict_SetItem, PyDict_DelItem
from cpython.long cimport PyLong_FromUnsignedLongLong
from cpython.object cimport PyObject, PyObject_Hash
from libc.stdint cimport uint64_t
from libc.string cimport memcpy

from xxhash import xxh3_128_digest

cdef extern from "Python.h":
    PyObject* PyDict_SetDefault(object d, object key, object default) except NULL
    unsigned long long PyLong_AsUnsignedLongLongMask(object value) except? -1


cdef inline bytearray _buffer(Py_ssize_t size):
    return PyByteArray_FromStringAndSize(NULL, size)


cdef inline void _fill(bytearray buf, bytes parent, const char* block, Py_ssize_t step):
    """buf := parent || block (parent is a 16-byte key; the caller sized buf for it)."""
    cdef char* out = PyByteArray_AS_STRING(buf)
    memcpy(out, PyBytes_AS_STRING(parent), 16)
    memcpy(out + 16, block, step)


def store_gpu_chain(index, w, list block_hashes, bytes parent_key, bytes tokens,
                    Py_ssize_t step, object bit, object flag, long fp_field):
    """``PrefixIndex.apply_stored``'s hot loop (a GPU chain without extra keys): bind each
    block's handle and place its node; a duplicate or changed handle goes through
    ``index._hold`` and a second handle of held content through ``index._add_second_handle``,
    in the order the blocks come. Returns how many blocks went through ``_hold``.

    The caller has checked that ``len(tokens) == len(block_hashes) * step``, that every key
    is 16 bytes (``parent_key``, and each digest) and ``w.handles``/``index._nodes`` are
    dicts."""
    cdef dict nodes = index._nodes
    cdef dict handles = w.handles
    cdef Py_ssize_t blocks = len(block_hashes)
    cdef Py_ssize_t k
    cdef const char* source = PyBytes_AS_STRING(tokens)
    cdef bytearray buf = _buffer(16 + step)
    cdef object seed = bit | flag
    cdef object block_hash, key, fresh, value
    cdef PyObject* bound
    cdef PyObject* placed
    cdef Py_ssize_t held_before = 0
    digest = xxh3_128_digest
    if len(parent_key) != 16:
        raise ValueError("a content key is 16 bytes")
    for k in range(blocks):
        block_hash = block_hashes[k]
        _fill(buf, parent_key, source + k * step, step)
        key = digest(buf)
        bound = PyDict_SetDefault(handles, block_hash, key)
        if bound == <PyObject*>key:
            fresh = seed | (PyObject_Hash(parent_key) & fp_field)
            placed = PyDict_SetDefault(nodes, key, fresh)
            if placed != <PyObject*>fresh:
                value = <object>placed
                if not (value & bit):
                    PyDict_SetItem(nodes, key, value | bit)
                else:
                    index._add_second_handle(w, key)
        else:
            held_before += 1
            index._hold(w, block_hash, key, 0,
                        (seed ^ bit) | (PyObject_Hash(parent_key) & fp_field))
        parent_key = key
        seed = bit
    return held_before


def remove_gpu(index, w, list block_hashes, object holders_min):
    """``PrefixIndex.apply_removed``'s hot loop (a worker whose every holding is "once on
    GPU"): forget each handle and take the worker's bit off its node, deleting a node left
    without holders. A hash the worker does not hold ends an unconfirmed block through
    ``index._end_unconfirmed`` or is counted unknown. Returns (removed, unknown)."""
    cdef dict nodes = index._nodes
    cdef dict handles = w.handles
    cdef object keep = w.keep
    cdef Py_ssize_t removed = 0
    cdef Py_ssize_t unknown = 0
    cdef object block_hash, key, value
    cdef PyObject* found
    for block_hash in block_hashes:
        found = PyDict_GetItem(handles, block_hash)
        if found is NULL:
            if not index._end_unconfirmed(w, (block_hash,)):
                unknown += 1
            continue
        key = <object>found
        PyDict_DelItem(handles, block_hash)
        value = nodes[key] & keep
        if value >= holders_min:
            PyDict_SetItem(nodes, key, value)
        else:
            PyDict_DelItem(nodes, key)
        removed += 1
    return removed, unknown


def walk_tokens(dict nodes, bytes parent_key, bytes tokens, Py_ssize_t step, object alive,
                bint tiered, object tiered_bit):
    """``PrefixIndex._walk_tokens``: hash the query block by block (full blocks only),
    dropping workers at their first miss. Returns ``ended`` (mask of workers, blocks they
    matched) and, when ``tiered``, the (key, holders) of matched blocks whose node has
    ``tiered_bit`` set.

    While the walked workers' bits all lie below bit 64 (fleets of up to 36 slots), the
    masks are C integers: a node's value enters as its low 64 bits, which is all of it that
    ``& alive`` (and the tier bit, bit 0) can see, and Python ints are made only for what
    is returned. Wider fleets take the same loop on Python ints."""
    if len(parent_key) != 16:
        raise ValueError("a content key is 16 bytes")
    if 0 <= alive < _WORD and 0 <= tiered_bit < _WORD:
        return _walk_word(nodes, parent_key, tokens, step, alive, tiered, tiered_bit)
    cdef list ended = []
    cdef list tiered_hits = []
    cdef Py_ssize_t blocks = len(tokens) // step
    cdef Py_ssize_t position
    cdef const char* source = PyBytes_AS_STRING(tokens)
    cdef bytearray buf = _buffer(16 + step)
    cdef object key, value, held
    cdef PyObject* found
    digest = xxh3_128_digest
    for position in range(blocks):
        _fill(buf, parent_key, source + position * step, step)
        key = digest(buf)
        found = PyDict_GetItem(nodes, key)
        value = 0 if found is NULL else <object>found
        held = value & alive
        if held != alive:
            ended.append((alive ^ held, position))
            alive = held
            if not alive:
                return ended, tiered_hits
        if tiered and value & tiered_bit:
            tiered_hits.append((key, alive))
        parent_key = key
    ended.append((alive, blocks))
    return ended, tiered_hits


cdef object _WORD = 1 << 64


cdef tuple _walk_word(dict nodes, bytes parent_key, bytes tokens, Py_ssize_t step,
                      uint64_t alive, bint tiered, uint64_t tiered_bit):
    """``walk_tokens`` with masks below bit 64 (the caller checked them)."""
    cdef list ended = []
    cdef list tiered_hits = []
    cdef Py_ssize_t blocks = len(tokens) // step
    cdef Py_ssize_t position
    cdef const char* source = PyBytes_AS_STRING(tokens)
    cdef bytearray buf = _buffer(16 + step)
    cdef object key
    cdef PyObject* found
    cdef uint64_t value, held
    digest = xxh3_128_digest
    for position in range(blocks):
        _fill(buf, parent_key, source + position * step, step)
        key = digest(buf)
        found = PyDict_GetItem(nodes, key)
        # Node values are non-negative ints: the mask keeps their low 64 bits.
        value = 0 if found is NULL else PyLong_AsUnsignedLongLongMask(<object>found)
        held = value & alive
        if held != alive:
            ended.append((PyLong_FromUnsignedLongLong(alive ^ held), position))
            alive = held
            if not alive:
                return ended, tiered_hits
        if tiered and value & tiered_bit:
            tiered_hits.append((key, PyLong_FromUnsignedLongLong(alive)))
        parent_key = key
    ended.append((PyLong_FromUnsignedLongLong(alive), blocks))
    return ended, tiered_hits

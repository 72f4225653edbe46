# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Compiled loops of the prefix index: the same work as the pure-Python loops of
``index.prefix_index`` on the same containers, without the interpreter's cost per block.

Every function here takes the index's own dicts and Python ints (node values, holder bits)
and changes them exactly as the pure loop it replaces would, operation for operation and
in the same order; anything off the common path is handed back to ``PrefixIndex``'s own
methods mid-loop, so the layout invariants (``PrefixIndex._check``) are the pure path's.
``KVROUTE_PURE=1`` selects the pure loops, which stay the reference: the tests run
both and check they agree on random event streams.

What the compiled loops save: per block, a content key is ``xxh3_128(parent key || block
tokens)``; the pure loop builds a 1-tuple, a block, a concatenation and a key object per
block, while this one copies both into one reused buffer and hashes it in C (the xxHash
library the ``xxhash`` package carries, checked against it at import: index/_keys.pxi), and
looks the key up in the compiled tables (index/_tables.pxi) without making an object of
it. Keys are byte for byte those of the pure path.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_FromStringAndSize
from cpython.dict cimport PyDict_GetItem
from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE
from cpython.long cimport PyLong_FromUnsignedLongLong
from cpython.object cimport PyObject
from libc.stdint cimport uint64_t
from libc.string cimport memcmp, memcpy

from array import array as _array

from xxhash import xxh3_128_digest

from kvroute.index.keys import TOKEN_TYPECODE
from kvroute.index.runs import MAX_PLAIN_BLOCK_SIZE, PLAIN_KINDS, TOKENS_PER_WORK, Run

include "_keys.pxi"
include "_tables.pxi"
include "_batch.pxi"

# Blocks hashed ahead of their lookups in ``_walk_word`` and ``_store_gpu_chain``. A key
# depends only on its parent key and its tokens, never on a lookup, so a run of keys can be
# made first, with the table slots each will look at fetched into the cache meanwhile, and
# then looked up: on an index larger than the CPU's caches each lookup is a few memory
# misses, and the processor overlaps those of neighbouring blocks. At most WALK_AHEAD - 1
# blocks past a walk's end are hashed for nothing.
DEF WALK_AHEAD = 16


cdef extern from "Python.h":
    PyObject* PyDict_SetDefault(object d, object key, object default) except NULL
    unsigned long long PyLong_AsUnsignedLongLongMask(object value) except? -1


cdef inline bytearray _buffer(Py_ssize_t size):
    return PyByteArray_FromStringAndSize(NULL, size)


def chain_keys(bytes tokens, Py_ssize_t block_size, bytes parent):
    """``index.placement.chain_keys`` of token bytes (``keys.token_bytes``) under the key
    ``parent``, in C: the same keys, one per full block, first block first."""
    cdef Py_ssize_t step = block_size * 4, i
    cdef Py_ssize_t blocks = PyBytes_GET_SIZE(tokens) // step if step > 0 else 0
    cdef uint64_t key[2]
    cdef const char* source = PyBytes_AS_STRING(tokens)
    cdef bytearray scratch = _buffer(16 + step)
    if PyBytes_GET_SIZE(parent) != 16:
        raise ValueError("a parent key is 16 bytes")
    memcpy(key, PyBytes_AS_STRING(parent), 16)
    keys = []
    for i in range(blocks):
        _key_into(key, key, source + i * step, step, scratch)
        keys.append(_key_bytes(key))
    return keys


cdef Py_ssize_t _key_group(uint64_t* keys, Py_ssize_t base, Py_ssize_t blocks, NodeMap nodes,
                           const char* source, Py_ssize_t step,
                           bytearray scratch) except -1:
    """The next group of a chain of ``blocks`` blocks of ``step`` bytes at ``source``: the
    keys of blocks ``base`` to ``base + count`` (``count``, returned, is at most
    WALK_AHEAD) into ``keys[2j + 2]`` and ``keys[2j + 3]``, each under the key before it,
    with the node slot each will be looked up in fetched meanwhile. ``keys[0:2]`` is
    block ``base``'s parent: the caller's for block 0, after that the last key of the
    group before (a full one: only the last group is shorter)."""
    cdef Py_ssize_t j
    cdef Py_ssize_t count = min(WALK_AHEAD, blocks - base)
    cdef const char* block = source + base * step
    if base:
        memcpy(keys, &keys[2 * WALK_AHEAD], 16)
    for j in range(count):
        _key_into(&keys[2 * j + 2], &keys[2 * j], block + j * step, step, scratch)
        nodes.prefetch(&keys[2 * j + 2])
    return count


def store_gpu_chain(index, w, list block_hashes, bytes parent_key, bytes tokens,
                    Py_ssize_t step, object bit, object flag, long fp_field):
    """See ``_store_gpu_chain`` (this is its entry point from Python)."""
    return _store_gpu_chain(index, w, block_hashes, NULL, len(block_hashes), parent_key,
                            PyBytes_AS_STRING(tokens), step, bit, flag, fp_field, None)


cdef inline object _hash_at(list block_hashes, const uint64_t* words, Py_ssize_t i):
    """Engine hash ``i`` of a chain given as a list, or as words (``block_hashes`` None)."""
    if block_hashes is None:
        return PyLong_FromUnsignedLongLong(words[i])
    return <object>PyList_GET_ITEM(block_hashes, i)


cdef Py_ssize_t _store_gpu_chain(index, w, list block_hashes, const uint64_t* hash_words,
                                 Py_ssize_t blocks, bytes parent_key, const char* source,
                                 Py_ssize_t step, object bit, object flag,
                                 long fp_field, list stored_keys) except -1:
    """``PrefixIndex.apply_stored``'s hot loop (a GPU chain without extra keys): bind each
    block's handle and place its node; a duplicate or changed handle goes through
    ``index._hold`` and a second handle of held content through ``index._add_second_handle``,
    in the order the blocks come. Returns how many blocks went through ``_hold``.

    Keys are made WALK_AHEAD blocks at a time, and the table slots they will look at are
    fetched into the cache meanwhile (see ``_walk_word``). Handles are placed in the
    worker's table records directly. So are nodes for a worker whose holder bit lies below
    bit 64; a wider fleet's worker's nodes do not fit a record and are placed in the node
    table's ``_other`` dict. Anything else (a hash kept in ``_other``) goes through the
    tables' dict methods, as the pure loop does.

    The engine hashes are ``block_hashes`` or, when that is None, ``blocks`` words at
    ``hash_words``; the tokens are ``blocks * step`` bytes at ``source``. Each block's
    content key is appended to ``stored_keys`` unless that is None (a run confirms them as
    placement guesses). The caller has checked that ``w.handles``/``index._nodes`` are the
    compiled tables."""
    cdef NodeMap nodes = index._nodes
    cdef HandleMap handles = w.handles
    cdef Py_ssize_t base, count, j
    cdef bytearray scratch = _buffer(16 + step)
    cdef uint64_t keys[2 * (WALK_AHEAD + 1)]  # see _key_group
    cdef uint64_t hashes[WALK_AHEAD]  # the group's engine hashes as handle-table keys
    cdef bint[WALK_AHEAD] packed  # ... where they fit one
    cdef uint64_t* key_words
    cdef object seed = bit | flag
    cdef object block_hash, key, fresh, value, fp
    cdef Py_ssize_t held_before = 0
    cdef bint narrow = bit < _UINT64_END, new_handle
    cdef uint64_t bit64 = PyLong_AsUnsignedLongLongMask(bit)
    cdef uint64_t seed64 = PyLong_AsUnsignedLongLongMask(seed)
    cdef Record* r
    if len(parent_key) != 16:
        raise ValueError("a content key is 16 bytes")
    memcpy(keys, PyBytes_AS_STRING(parent_key), 16)
    base = 0
    while base < blocks:
        count = _key_group(keys, base, blocks, nodes, source, step, scratch)
        for j in range(count):
            if block_hashes is None:
                hashes[j] = hash_words[base + j]
                packed[j] = True
            else:
                packed[j] = handles._pack_key(
                    <object>PyList_GET_ITEM(block_hashes, base + j), &hashes[j])
            if packed[j]:
                handles.prefetch(&hashes[j])
        for j in range(count):
            block_hash = None
            key_words = &keys[2 * j + 2]
            if stored_keys is not None:
                stored_keys.append(_key_bytes(key_words))
            if (packed[j] and not handles._other
                    and (key_words[0] | key_words[1])):  # an all-zero key is not a record's
                new_handle = handles.find(&hashes[j]) is NULL
                if new_handle:
                    r = handles.add(&hashes[j])
                    memcpy(&r.w[1], key_words, 16)
            else:
                key = _key_bytes(key_words)
                block_hash = _hash_at(block_hashes, hash_words, base + j)
                new_handle = handles.setdefault(block_hash, key) is key
            if not new_handle:
                if block_hash is None:
                    block_hash = _hash_at(block_hashes, hash_words, base + j)
                held_before += 1
                fp = _fingerprint_hash(&keys[2 * j]) & fp_field
                index._hold(w, block_hash, _key_bytes(key_words), 0, (seed ^ bit) | fp)
            elif narrow:
                r = nodes.find(key_words)
                if r is not NULL:
                    if r.w[2] & bit64:
                        index._add_second_handle(w, _key_bytes(key_words))
                    else:
                        r.w[2] |= bit64
                else:
                    key = _key_bytes(key_words) if nodes._other else None
                    if key is None or key not in nodes._other:
                        r = nodes.add(key_words)
                        r.w[2] = seed64 | <uint64_t>(_fingerprint_hash(&keys[2 * j]) & fp_field)
                    elif not (nodes._other[key] & bit):
                        nodes[key] = nodes._other[key] | bit
                    else:
                        index._add_second_handle(w, key)
            else:  # a wide worker's nodes are kept in nodes._other (their values do not fit)
                key = _key_bytes(key_words)
                r = nodes.find(key_words)
                if r is not NULL:  # held by narrow workers only: it moves to _other
                    nodes[key] = PyLong_FromUnsignedLongLong(r.w[2]) | bit
                else:
                    fp = _fingerprint_hash(&keys[2 * j]) & fp_field
                    fresh = seed | fp
                    value = <object>PyDict_SetDefault(nodes._other, key, fresh)
                    if value is not fresh:
                        if not (value & bit):
                            nodes._other[key] = value | bit
                        else:
                            index._add_second_handle(w, key)
            seed = bit
            seed64 = bit64
        base += count
    return held_before


def remove_gpu(index, w, list block_hashes, object holders_min):
    """``PrefixIndex.apply_removed``'s hot loop (a worker whose every holding is "once on
    GPU"): forget each handle and take the worker's bit off its node, deleting a node left
    without holders. A hash the worker does not hold ends an unconfirmed block through
    ``index._end_unconfirmed`` or is counted unknown. Returns (removed, unknown)."""
    cdef NodeMap nodes = index._nodes
    cdef HandleMap handles = w.handles
    cdef object keep = w.keep
    cdef Py_ssize_t removed = 0
    cdef Py_ssize_t unknown = 0
    cdef object block_hash
    for block_hash in block_hashes:
        if _take_off(nodes, handles, keep, holders_min, block_hash, 0):
            removed += 1
        elif not index._end_unconfirmed(w, (block_hash,)):
            unknown += 1
    return removed, unknown


cdef bint _take_off(NodeMap nodes, HandleMap handles, object keep, object holders_min,
                    object block_hash, uint64_t word) except -1:
    """Forget the worker's handle for ``block_hash`` (None: for the int ``word``) and take
    its bit (``keep`` masks it off) off the node, deleting a node left without holders;
    False when it holds no such hash."""
    cdef uint64_t hw[3]
    cdef uint64_t kw[3]
    cdef Record* r
    cdef uint64_t value64
    cdef object key, value
    cdef bint packed = block_hash is None
    if packed:
        hw[0] = word
    else:
        packed = handles._pack_key(block_hash, hw)
    if packed and not handles._other:
        r = handles.find(hw)
        if r is NULL:
            return False
        memcpy(kw, &r.w[1], 16)
        handles.remove(hw)
        r = nodes.find(kw)
        if r is not NULL:
            value64 = r.w[2] & PyLong_AsUnsignedLongLongMask(keep)
            if value64 >= PyLong_AsUnsignedLongLongMask(holders_min):
                r.w[2] = value64
            else:
                nodes.remove(kw)
            return True
        key = PyBytes_FromStringAndSize(<const char*>kw, 16)
    else:
        if block_hash is None:
            block_hash = PyLong_FromUnsignedLongLong(word)
        key = handles.get(block_hash)
        if key is None:
            return False
        del handles[block_hash]
    value = nodes[key] & keep
    if value >= holders_min:
        nodes[key] = value
    else:
        del nodes[key]
    return True


def clear_handles(index, w, uint64_t tiered_flag, object holders_min):
    """``PrefixIndex.clear_worker``'s loop: take ``w``'s bit off the node of every one of
    its handles, deleting nodes left without holders, as ``index._let_go`` does for one
    key. Nodes with ``tiered_flag`` set (their tier entry changes too), nodes kept in
    ``_other``, handles kept in ``_other`` and every handle of a worker whose bit lies past
    bit 63 go through ``index._let_go``. The handles themselves are left for the caller
    to drop."""
    cdef NodeMap nodes = index._nodes
    cdef HandleMap handles = w.handles
    cdef object bit = w.bit
    cdef uint64_t bit64, value, holders_min64 = PyLong_AsUnsignedLongLongMask(holders_min)
    cdef uint64_t kw[2]
    cdef Py_ssize_t k
    cdef Record* r
    let_go = index._let_go
    if bit >= _UINT64_END:
        for key in handles.values():
            let_go(w, key)
        return
    bit64 = PyLong_AsUnsignedLongLongMask(bit)
    for k in range(handles.used):  # the handles do not change meanwhile
        if k + WALK_AHEAD < handles.used:  # the node slot a later handle will look at
            nodes.prefetch(&handles.records[k + WALK_AHEAD].w[1])
        if not handles._live(&handles.records[k]):
            continue
        memcpy(kw, &handles.records[k].w[1], 16)
        r = nodes.find(kw)
        if r is NULL or r.w[2] & tiered_flag:
            let_go(w, _key_bytes(kw))
        elif r.w[2] & bit64:  # else a second handle of the same content, already let go
            value = r.w[2] & ~bit64
            if value >= holders_min64:
                r.w[2] = value
            else:
                nodes.remove(kw)
    for key in list(handles._other.values()):
        let_go(w, key)


cdef inline uint64_t _low_value(NodeMap nodes, const uint64_t* key) except? 0xFFFFFFFFFFFFFFFF:
    """The low 64 bits of ``key``'s node value (0: no node), all a mask below bit 64 sees."""
    cdef Record* r = nodes.find(key)
    if r is not NULL:
        return r.w[2]
    if not nodes._other:
        return 0
    cdef PyObject* found = PyDict_GetItem(nodes._other, _key_bytes(key))
    return 0 if found is NULL else PyLong_AsUnsignedLongLongMask(<object>found)


def walk_tokens(NodeMap nodes, bytes parent_key, bytes tokens, Py_ssize_t step, object alive,
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
    cdef bytearray scratch = _buffer(16 + step)
    cdef uint64_t key_words[2]
    cdef object key, value, held
    memcpy(key_words, PyBytes_AS_STRING(parent_key), 16)
    for position in range(blocks):
        _key_into(key_words, key_words, source + position * step, step, scratch)
        key = _key_bytes(key_words)
        value = nodes.get(key, 0)
        held = value & alive
        if held != alive:
            ended.append((alive ^ held, position))
            alive = held
            if not alive:
                return ended, tiered_hits
        if tiered and value & tiered_bit:
            tiered_hits.append((key, alive))
    ended.append((alive, blocks))
    return ended, tiered_hits


cdef object _WORD = 1 << 64


def extent(NodeMap nodes, list keys, object bit, object guessed, object unconfirmed,
           Py_ssize_t held=0):
    """``Placements.extent`` for a worker whose holder bit lies below bit 64, its
    ``really_holds`` being that bit set on the key's node: (blocks, of which pending), how
    many of ``keys`` from the first it really holds, is ``guessed`` to hold or holds
    ``unconfirmed`` (both containers of keys). The caller knows the worker really holds
    the first ``held`` keys (its match): they are counted, not looked up. The rest are
    looked up in C; a Python call per key, for every worker with a guess, added up on a
    long prompt."""
    if not 0 < bit < _WORD:
        raise ValueError("a holder bit below bit 64")
    if not 0 <= held <= len(keys):
        raise ValueError("held is more keys than there are")
    cdef uint64_t bit64 = PyLong_AsUnsignedLongLong(bit)
    cdef uint64_t words[2]
    cdef Py_ssize_t count = held, pending = 0, i
    cdef object key
    for i in range(held, len(keys)):
        key = <object>PyList_GET_ITEM(keys, i)
        if type(key) is not bytes or PyBytes_GET_SIZE(key) != 16:
            raise ValueError("a content key is 16 bytes")
        memcpy(words, PyBytes_AS_STRING(key), 16)
        if _low_value(nodes, words) & bit64:
            count += 1
        elif key in guessed or key in unconfirmed:
            count += 1
            pending += 1
        else:
            break
    return count, pending


cdef tuple _walk_word(NodeMap nodes, bytes parent_key, bytes tokens, Py_ssize_t step,
                      uint64_t alive, bint tiered, uint64_t tiered_bit):
    """``walk_tokens`` with masks below bit 64 (the caller checked them)."""
    cdef list ended = []
    cdef list tiered_hits = []
    cdef Py_ssize_t blocks = len(tokens) // step
    cdef Py_ssize_t base, count, j
    cdef const char* source = PyBytes_AS_STRING(tokens)
    cdef bytearray scratch = _buffer(16 + step)
    cdef uint64_t keys[2 * (WALK_AHEAD + 1)]  # see _key_group
    cdef uint64_t[WALK_AHEAD] values
    cdef uint64_t value, held
    memcpy(keys, PyBytes_AS_STRING(parent_key), 16)
    base = 0
    while base < blocks:
        count = _key_group(keys, base, blocks, nodes, source, step, scratch)
        for j in range(count):
            values[j] = _low_value(nodes, &keys[2 * j + 2])
        for j in range(count):
            value = values[j]
            held = value & alive
            if held != alive:
                ended.append((PyLong_FromUnsignedLongLong(alive ^ held), base + j))
                alive = held
                if not alive:
                    return ended, tiered_hits
            if tiered and value & tiered_bit:
                tiered_hits.append((_key_bytes(&keys[2 * j + 2]),
                                    PyLong_FromUnsignedLongLong(alive)))
        base += count
    ended.append((PyLong_FromUnsignedLongLong(alive), blocks))
    return ended, tiered_hits


# --- runs of plain events (index.runs) -------------------------------------------------------

from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.long cimport PyLong_AsUnsignedLong
from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from libc.stdint cimport uint32_t

from msgspec import Raw

from kvroute.index.keys import root_key

cdef object _UINT32_END = 2**32


cdef inline bint _gpu_group_zero(object event):
    """Whether a store or removal names the GPU tier (or none), KV-cache group 0 (or none)
    and no locality: the only place a run applies (`index.runs.on_gpu_group_zero`)."""
    medium = event.medium
    if medium is not None and medium != "GPU":
        return False
    group = event.group_idx
    return (group is None or group == 0) and getattr(event, "locality", None) is None


cdef inline bint _plain_hashes(object hashes):
    """Every item an int >= 0 (a list: checked by the caller)."""
    cdef Py_ssize_t i
    cdef object h
    for i in range(PyList_GET_SIZE(hashes)):
        h = <object>PyList_GET_ITEM(hashes, i)
        if type(h) is not int or h < 0:
            return False
    return True


cdef object _packed_tokens(list tokens):
    """Token ids as uint32 bytes (``keys.token_bytes``), or None when one is not an int
    in [0, 2**32)."""
    cdef Py_ssize_t count = PyList_GET_SIZE(tokens)
    cdef Py_ssize_t i
    cdef object t
    cdef bytes out = PyBytes_FromStringAndSize(NULL, count * 4)
    cdef uint32_t* data = <uint32_t*>PyBytes_AS_STRING(out)
    for i in range(count):
        t = <object>PyList_GET_ITEM(tokens, i)
        if type(t) is not int or t < 0 or t >= _UINT32_END:
            return None
        data[i] = <uint32_t>PyLong_AsUnsignedLong(t)
    return out


cdef object _raw_tokens(object raw):
    """``msgspec.Raw`` token ids (a msgpack array) as uint32 bytes, or None when they are not
    an array of ints in [0, 2**32) (what ``index.runs.token_list`` and a range check say)."""
    cdef Py_buffer view
    PyObject_GetBuffer(raw, &view, PyBUF_SIMPLE)
    try:
        return _parse_tokens(<const unsigned char*>view.buf, view.len)
    finally:
        PyBuffer_Release(&view)


cdef inline unsigned long long _be(const unsigned char* p, int size) noexcept nogil:
    cdef unsigned long long v = 0
    cdef int i
    for i in range(size):
        v = (v << 8) | p[i]
    return v


cdef object _parse_tokens(const unsigned char* p, Py_ssize_t n):
    cdef Py_ssize_t pos, count
    cdef unsigned char b
    if n < 1:
        return None
    b = p[0]
    if 0x90 <= b <= 0x9f:
        count, pos = b & 0x0f, 1
    elif b == 0xdc and n >= 3:
        count, pos = <Py_ssize_t>_be(p + 1, 2), 3
    elif b == 0xdd and n >= 5:
        count, pos = <Py_ssize_t>_be(p + 1, 4), 5
    else:
        return None
    if count > n - pos:  # every element takes a byte at least
        return None
    cdef bytes out = PyBytes_FromStringAndSize(NULL, count * 4)
    pos = _token_words(p, n, pos, count, <uint32_t*>PyBytes_AS_STRING(out))
    return out if pos == n else None


cdef Py_ssize_t _token_words(const unsigned char* p, Py_ssize_t n, Py_ssize_t pos,
                             Py_ssize_t count, uint32_t* data) noexcept nogil:
    """``count`` msgpack ints from ``p[pos:n]`` into ``data``, each in [0, 2**32); the
    position after them, or -1 when one is not such an int (or the bytes end first)."""
    cdef Py_ssize_t i
    cdef unsigned char b
    cdef unsigned long long v
    cdef int size
    for i in range(count):
        if pos >= n:
            return -1
        b = p[pos]
        pos += 1
        if b <= 0x7f:  # positive fixint
            data[i] = b
            continue
        # The common encodings of token ids first, without a loop over their bytes.
        if b == 0xcd and pos + 2 <= n:
            data[i] = (<uint32_t>p[pos] << 8) | p[pos + 1]
            pos += 2
            continue
        if b == 0xce and pos + 4 <= n:
            data[i] = ((<uint32_t>p[pos] << 24) | (<uint32_t>p[pos + 1] << 16)
                       | (<uint32_t>p[pos + 2] << 8) | p[pos + 3])
            pos += 4
            continue
        if 0xcc <= b <= 0xcf:  # uint 8/16/32/64
            size = 1 << (b - 0xcc)
        elif 0xd0 <= b <= 0xd3:  # int 8/16/32/64: only non-negative values are plain
            size = 1 << (b - 0xd0)
            if pos < n and p[pos] & 0x80:
                return -1
        else:  # a negative fixint, or not an int
            return -1
        if pos + size > n:
            return -1
        v = _be(p + pos, size)
        pos += size
        if v >> 32:  # over 2**32 - 1
            return -1
        data[i] = <uint32_t>v
    return pos


def apply_run(index, worker, object events, Py_ssize_t start, Py_ssize_t work_left,
              Py_ssize_t events_left, limits, long fp_field, object first_flag,
              object holders_min, int gpu):
    """``index.runs.apply_run``: the same events applied, the same ``Run`` returned, with
    each plain store's chain placed by ``_store_gpu_chain`` and each plain removal's
    hashes released as ``remove_gpu`` releases them, without a Python call per event.

    ``events`` is a list of decoded events or a ``PlainBatch`` (index/_batch.pxi), whose
    events are plain in form already: for those only the checks against the worker's
    state and the limits are left (the same checks, in the same place)."""
    run = Run(start)
    w = index._workers.get(worker)
    if w is None:
        return run
    # The content keys stored, when the worker has placement guesses: they are guesses no
    # more (apply_stored confirms them as it stores, a run once it ends).
    cdef list stored_keys = [] if index.placements.has(worker) else None
    cdef list listed = events if type(events) is list else None
    cdef PlainBatch batch = None if listed is not None else <PlainBatch?>events
    cdef Py_ssize_t count = len(events)
    cdef object stored = limits.stored
    cdef object removed = limits.removed
    cdef Py_ssize_t max_event_blocks = limits.max_event_blocks
    cdef Py_ssize_t max_worker_blocks = limits.max_worker_blocks
    cdef Py_ssize_t max_work = limits.max_work
    cdef HandleMap handles = w.handles
    cdef dict groups = w.groups
    cdef list held = w.held
    cdef Py_ssize_t k, blocks, work, size, ntokens, done_blocks = 0, done_work = 0
    cdef object event, hashes, tokens, extra, parent, parent_key, packed, flag
    cdef object root = None
    cdef Py_ssize_t root_size = 0
    cdef object bound_size = None
    cdef dict counts = w.counts
    cdef dict node_counts = w.node_counts
    cdef NodeMap nodes = index._nodes
    cdef object keep = w.keep
    cdef object bit = w.bit
    cdef object cls
    cdef Py_ssize_t i
    cdef _PlainEvent* plain
    cdef const uint64_t* hash_words = NULL
    cdef const char* token_bytes
    # Kept in C until the run ends (nothing a run calls reads them in between).
    cdef Py_ssize_t held_delta = 0, unknown_total = 0, next_event = start
    # The exact classes, to tell most events apart without isinstance.
    cdef tuple store_classes = stored if type(stored) is tuple else (stored,)
    cdef tuple removal_classes = removed if type(removed) is tuple else (removed,)
    cdef bint is_store, is_removal
    for k in range(start, count):
        if k - start >= events_left:
            run.full = True
            break
        hashes = None  # a PlainBatch's hashes are words (hash_words)
        if batch is not None:
            plain = &batch.events[k]
            if plain.hashes_at >= 0 or plain.tokens_at >= 0:
                break  # lists left in the payload: far more work than a run's bound
            is_store = plain.kind == _STORE
            is_removal = not is_store
            blocks = plain.blocks
            hash_words = &batch.hashes[plain.first_hash]
            if is_store:
                size = plain.block_size
                ntokens = plain.tokens
                token_bytes = <const char*>&batch.tokens[plain.first_token]
                parent = batch.parent_of(k)
        else:
            event = <object>PyList_GET_ITEM(listed, k)
            cls = type(event)
            is_removal = cls in removal_classes
            is_store = not is_removal and (cls in store_classes or isinstance(event, stored))
            if not is_store and not is_removal:
                is_removal = isinstance(event, removed)
            if is_store:
                # index.runs.plain_store's checks of the event alone
                if not _gpu_group_zero(event):
                    break
                if (event.kv_cache_spec_kind not in PLAIN_KINDS or event.lora_name is not None
                        or event.lora_id is not None
                        or getattr(event, "lookahead_token_ids", None) is not None):
                    break
                hashes = event.block_hashes
                tokens = event.token_ids
                if type(hashes) is not list:
                    break
                if type(tokens) is list:
                    packed = _packed_tokens(tokens)
                elif type(tokens) is Raw:
                    packed = _raw_tokens(tokens)
                else:
                    break
                if packed is None:
                    break
                blocks = PyList_GET_SIZE(hashes)
                extra = event.extra_keys
                if extra is not None and (type(extra) is not list or len(extra) != blocks
                                          or extra.count(None) != blocks):
                    break
                bound_size = event.block_size
                if blocks <= 0 or type(bound_size) is not int:
                    break
                if bound_size <= 0 or bound_size > MAX_PLAIN_BLOCK_SIZE:
                    break
                size = bound_size
                ntokens = PyBytes_GET_SIZE(packed) // 4
                if ntokens != blocks * size or not _plain_hashes(hashes):
                    break
                token_bytes = PyBytes_AS_STRING(packed)
                parent = event.parent_block_hash
                if parent is not None and (type(parent) is not int or parent < 0):
                    break
            elif is_removal:
                if not _gpu_group_zero(event):
                    break
                hashes = event.block_hashes
                if type(hashes) is not list or not _plain_hashes(hashes):
                    break
                blocks = PyList_GET_SIZE(hashes)
            else:
                break
        if is_store:
            # index.runs.plain_store's checks against the limits and the worker's state
            if blocks > max_event_blocks or w.lookahead:
                break
            work = max(blocks, ntokens // TOKENS_PER_WORK)
            if work > max_work or len(handles) + blocks > max_worker_blocks:
                break
            if parent is None:
                if root is None or root_size != size:
                    root = root_key(size, None)
                    root_size = size
                parent_key = root
                flag = first_flag
            else:
                parent_key = handles.get(parent)
                if parent_key is None:
                    break
                flag = 0
            if work > work_left:
                run.full = True
                break
            # Plain: from here on it changes the index, as apply_stored would.
            try:
                if groups.get(0) is not True:
                    groups[0] = True
                if w.block_size != size:
                    index._set_block_size(w, size)
                if w.unconfirmed:  # saved blocks this store names are unconfirmed no more
                    index._end_unconfirmed(w, hashes if hashes is not None else [
                        PyLong_FromUnsignedLongLong(hash_words[i]) for i in range(blocks)])
                held_delta += blocks - _store_gpu_chain(index, w, hashes, hash_words, blocks,
                                                        parent_key, token_bytes, size * 4,
                                                        bit, flag, fp_field, stored_keys)
            except Exception as exc:  # only an internal limit (see index.runs)
                next_event = k + 1
                run.error = exc
                break
        else:
            if blocks > max_work or groups.get(0) is False or counts or node_counts:
                break
            work = blocks
            if work > work_left:
                run.full = True
                break
            # remove_gpu's loop: a hash the worker does not hold ends an unconfirmed
            # block, or is unknown.
            for i in range(blocks):
                if (_take_off(nodes, handles, keep, holders_min, None, hash_words[i])
                        if hashes is None else
                        _take_off(nodes, handles, keep, holders_min,
                                  <object>PyList_GET_ITEM(hashes, i), 0)):
                    held_delta -= 1
                elif not w.unconfirmed or not index._end_unconfirmed(w, (
                        PyLong_FromUnsignedLongLong(hash_words[i]) if hashes is None
                        else <object>PyList_GET_ITEM(hashes, i),)):
                    unknown_total += 1
        next_event = k + 1
        done_blocks += blocks
        done_work += work
        work_left -= work
    if held_delta:
        held[gpu] += held_delta
    if stored_keys:
        index.placements.confirm(worker, stored_keys)
    if unknown_total:
        index._unknown_removals += unknown_total
    run.next = next_event
    run.blocks = done_blocks
    run.work = done_work
    return run


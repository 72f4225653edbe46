# Included by _fast.pyx: a vLLM event batch read straight from its msgpack bytes into C
# arrays, for ``apply_run`` to apply without an object per event, hash or token.
#
# ``read_plain_batch`` accepts a payload only when every one of its events is *plain in
# form*: a GPU (or unnamed) store or removal in KV-cache group 0 (or none), no LoRA, no extra
# keys, non-negative int hashes, a block size in (0, 2**20], token ids in [0, 2**32) and
# ``blocks * block_size`` of them (``index.runs``' static checks, which are stricter than
# the decoder's types), and nil locality, ownership and session id. Anything else, in any event, and it returns None: the caller decodes
# the payload the ordinary way (``app.ingest.wire.decode_batch``). So for an accepted payload
# ``decode_batch`` gives the same events, one for one, none left out as malformed or
# unknown; ``apply_run`` stops at an event that is not plain for the worker's state (an
# unheld parent, a cap), and the caller continues from that event's index in the decoded
# list. Unknown map keys are skipped, as the decoder skips them; a key given twice, a map
# event whose first key is not "type", an envelope or event array longer than its fields,
# or a map envelope is refused, not interpreted.

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer

DEF _STORE = 1
DEF _REMOVAL = 2
DEF _MAX_DEPTH = 32  # nesting a skipped value may have
# A longer list is checked in the reading but left in the payload, and decoded a piece at a
# time (``PlainBatch.piece``): copying a 300,000-block store's lists in one call faulted in
# 21 MB of fresh memory, a long stall. No run takes such an event (its work
# is far over a run's bound anyway).
DEF _COPIED_ITEMS = 1 << 16
DEF _SCRATCH_TOKENS = 4096

cdef struct _PlainEvent:
    int kind
    Py_ssize_t first_hash  # into PlainBatch.hashes
    Py_ssize_t blocks
    bint has_parent
    uint64_t parent
    Py_ssize_t block_size
    Py_ssize_t first_token  # into PlainBatch.tokens
    Py_ssize_t tokens
    # A list left in the payload (over _COPIED_ITEMS): where its first item is, else -1;
    # and how far ``piece`` has read it (item number, position), to go on from there.
    Py_ssize_t hashes_at
    Py_ssize_t hashes_read
    Py_ssize_t hashes_read_at
    Py_ssize_t tokens_at
    Py_ssize_t tokens_read
    Py_ssize_t tokens_read_at

cdef struct _Reader:
    const unsigned char* p
    Py_ssize_t n
    Py_ssize_t pos


cdef class PlainBatch:
    """One payload's envelope and events, every event plain in form (module text above).
    ``len()`` is its event count; ``event(k)`` shows event k as plain Python values (for
    tests and logs)."""

    cdef readonly double ts
    cdef readonly object data_parallel_rank
    cdef Py_buffer payload  # held until the batch goes: lists left in it are read from it
    cdef bint has_payload
    cdef Py_ssize_t count
    cdef _PlainEvent* events
    cdef uint64_t* hashes
    cdef Py_ssize_t hashes_used, hashes_room
    cdef uint32_t* tokens
    cdef Py_ssize_t tokens_used, tokens_room

    def __dealloc__(self):
        if self.has_payload:
            PyBuffer_Release(&self.payload)
        free(self.events)
        free(self.hashes)
        free(self.tokens)

    def __len__(self):
        return self.count

    def event(self, Py_ssize_t k):
        """Event ``k`` as ``(type, block_hashes, parent_block_hash, token_ids, block_size)``
        (a removal: no parent, no tokens, block size 0)."""
        if not 0 <= k < self.count:
            raise IndexError(k)
        cdef _PlainEvent* e = &self.events[k]
        hashes, tokens = self.piece(k, 0, e.blocks)
        if e.kind == _REMOVAL:
            return ("BlockRemoved", hashes, None, [], 0)
        return ("BlockStored", hashes, self.parent_of(k), list(tokens), e.block_size)

    def left_in_payload(self, Py_ssize_t k):
        """Whether event ``k`` has a list left in the payload (no run takes it)."""
        if not 0 <= k < self.count:
            raise IndexError(k)
        return self.events[k].hashes_at >= 0 or self.events[k].tokens_at >= 0

    def head(self, Py_ssize_t k):
        """Event ``k`` without its lists: ``(type, blocks, parent_block_hash, block_size)``."""
        if not 0 <= k < self.count:
            raise IndexError(k)
        cdef _PlainEvent* e = &self.events[k]
        if e.kind == _REMOVAL:
            return ("BlockRemoved", e.blocks, None, 0)
        return ("BlockStored", e.blocks, self.parent_of(k), e.block_size)

    def piece(self, Py_ssize_t k, Py_ssize_t start, Py_ssize_t end):
        """Blocks ``[start, end)`` of event ``k``: ``(block_hashes, token_ids)``, the hashes
        a list and the token ids a ``TOKEN_TYPECODE`` array (empty for a removal). Costs
        the piece, not the event: a huge event is rebuilt a slice at a time."""
        if not 0 <= k < self.count:
            raise IndexError(k)
        cdef _PlainEvent* e = &self.events[k]
        if not 0 <= start <= end <= e.blocks:
            raise IndexError((start, end))
        cdef _Reader r
        cdef uint64_t value
        cdef Py_ssize_t i
        cdef bytes words
        if e.hashes_at < 0:
            hashes = [PyLong_FromUnsignedLongLong(self.hashes[e.first_hash + i])
                      for i in range(start, end)]
        else:
            self._reader(&r, e.hashes_read_at if start >= e.hashes_read else e.hashes_at)
            for i in range(e.hashes_read if start >= e.hashes_read else 0, start):
                _uint(&r, &value)  # checked in the reading: an int < 2**64
            hashes = []
            for i in range(start, end):
                _uint(&r, &value)
                hashes.append(PyLong_FromUnsignedLongLong(value))
            e.hashes_read, e.hashes_read_at = end, r.pos
        tokens = _array(TOKEN_TYPECODE)
        if e.kind != _STORE or end == start:
            return hashes, tokens
        if e.tokens_at < 0:
            tokens.frombytes(PyBytes_FromStringAndSize(
                <const char*>&self.tokens[e.first_token + start * e.block_size],
                (end - start) * e.block_size * sizeof(uint32_t)))
            return hashes, tokens
        self._reader(&r, e.tokens_read_at if start * e.block_size >= e.tokens_read
                     else e.tokens_at)
        r.pos = _checked_tokens(&r, start * e.block_size - (
            e.tokens_read if start * e.block_size >= e.tokens_read else 0))
        words = PyBytes_FromStringAndSize(NULL, (end - start) * e.block_size * sizeof(uint32_t))
        r.pos = _token_words(r.p, r.n, r.pos, (end - start) * e.block_size,
                             <uint32_t*>PyBytes_AS_STRING(words))
        e.tokens_read, e.tokens_read_at = end * e.block_size, r.pos
        tokens.frombytes(words)
        return hashes, tokens

    cdef void _reader(self, _Reader* r, Py_ssize_t pos) noexcept:
        r.p = <const unsigned char*>self.payload.buf
        r.n = self.payload.len
        r.pos = pos

    cdef object parent_of(self, Py_ssize_t k):
        cdef _PlainEvent* e = &self.events[k]
        return PyLong_FromUnsignedLongLong(e.parent) if e.has_parent else None

    cdef int _room(self, Py_ssize_t hashes, Py_ssize_t tokens) except -1:
        """Room for ``hashes`` more hashes and ``tokens`` more token ids."""
        cdef Py_ssize_t room
        cdef void* grown
        if self.hashes_used + hashes > self.hashes_room:
            room = max(2 * self.hashes_room, self.hashes_used + hashes, 64)
            grown = realloc(self.hashes, room * sizeof(uint64_t))
            if grown is NULL:
                raise MemoryError()
            self.hashes, self.hashes_room = <uint64_t*>grown, room
        if self.tokens_used + tokens > self.tokens_room:
            room = max(2 * self.tokens_room, self.tokens_used + tokens, 1024)
            grown = realloc(self.tokens, room * sizeof(uint32_t))
            if grown is NULL:
                raise MemoryError()
            self.tokens, self.tokens_room = <uint32_t*>grown, room
        return 0


# --- msgpack, only what the batch reader needs; every reader returns False on anything
# --- it does not take (a wrong type, a truncated value), leaving the position unspecified.

cdef inline bint _nil(_Reader* r):
    """Consume a nil if one is next."""
    if r.pos < r.n and r.p[r.pos] == 0xc0:
        r.pos += 1
        return True
    return False


cdef bint _uint(_Reader* r, uint64_t* out) noexcept nogil:
    """A non-negative int (any msgpack int encoding) that fits 64 bits."""
    cdef unsigned char b
    cdef int size
    if r.pos >= r.n:
        return False
    b = r.p[r.pos]
    r.pos += 1
    if b <= 0x7f:
        out[0] = b
        return True
    if b == 0xcf or b == 0xd3:
        size = 8
    elif b == 0xce or b == 0xd2:
        size = 4
    elif b == 0xcd or b == 0xd1:
        size = 2
    elif b == 0xcc or b == 0xd0:
        size = 1
    else:
        return False
    if r.pos + size > r.n or (b >= 0xd0 and r.p[r.pos] & 0x80):  # a negative signed int
        return False
    out[0] = _be(r.p + r.pos, size)
    r.pos += size
    return True


cdef Py_ssize_t _header(_Reader* r, unsigned char fix, unsigned char wide16) except -2:
    """The length of an array (``fix`` 0x90, ``wide16`` 0xdc) or a map (0x80, 0xde); -1
    when something else is next. A length is checked against the bytes left (every item
    takes one at least)."""
    cdef unsigned char b
    cdef Py_ssize_t length
    if r.pos >= r.n:
        return -1
    b = r.p[r.pos]
    if fix <= b <= fix + 0x0f:
        length = b & 0x0f
        r.pos += 1
    elif b == wide16 and r.pos + 3 <= r.n:
        length = <Py_ssize_t>_be(r.p + r.pos + 1, 2)
        r.pos += 3
    elif b == wide16 + 1 and r.pos + 5 <= r.n:
        length = <Py_ssize_t>_be(r.p + r.pos + 1, 4)
        r.pos += 5
    else:
        return -1
    return length if length <= r.n - r.pos else -1


cdef bint _str(_Reader* r, const unsigned char** s, Py_ssize_t* length):
    cdef unsigned char b
    cdef Py_ssize_t size = 0, head = 1
    if r.pos >= r.n:
        return False
    b = r.p[r.pos]
    if 0xa0 <= b <= 0xbf:
        size = b & 0x1f
    elif b == 0xd9 and r.pos + 2 <= r.n:
        size, head = r.p[r.pos + 1], 2
    elif b == 0xda and r.pos + 3 <= r.n:
        size, head = <Py_ssize_t>_be(r.p + r.pos + 1, 2), 3
    elif b == 0xdb and r.pos + 5 <= r.n:
        size, head = <Py_ssize_t>_be(r.p + r.pos + 1, 4), 5
    else:
        return False
    if size > r.n - r.pos - head:
        return False
    s[0] = r.p + r.pos + head
    length[0] = size
    r.pos += head + size
    return True


cdef inline bint _is(const unsigned char* s, Py_ssize_t length, bytes word):
    return length == PyBytes_GET_SIZE(word) and memcmp(s, PyBytes_AS_STRING(word), length) == 0


cdef Py_ssize_t _checked_tokens(_Reader* r, Py_ssize_t count) noexcept nogil:
    """Step over ``count`` token ids, each checked as ``_token_words`` checks it: the
    position after them, or -1."""
    cdef uint32_t scratch[_SCRATCH_TOKENS]
    cdef Py_ssize_t pos = r.pos, step
    while count > 0 and pos >= 0:
        step = min(count, _SCRATCH_TOKENS)
        pos = _token_words(r.p, r.n, pos, step, scratch)
        count -= step
    return pos


cdef bint _checked_hashes(_Reader* r, Py_ssize_t count) noexcept nogil:
    """Step over ``count`` block hashes, each an int below 2**64."""
    cdef uint64_t value
    cdef Py_ssize_t i
    for i in range(count):
        if not _uint(r, &value):
            return False
    return True


cdef bint _skip(_Reader* r, int depth):
    """Step over any one msgpack value."""
    cdef unsigned char b
    cdef Py_ssize_t items, i
    if r.pos >= r.n or depth > _MAX_DEPTH:
        return False
    b = r.p[r.pos]
    if b <= 0x7f or b >= 0xe0 or b == 0xc0 or b == 0xc2 or b == 0xc3:
        r.pos += 1
        return True
    if 0x80 <= b <= 0x8f or b == 0xde or b == 0xdf:
        items = 2 * _header(r, 0x80, 0xde)
    elif 0x90 <= b <= 0x9f or b == 0xdc or b == 0xdd:
        items = _header(r, 0x90, 0xdc)
    elif 0xa0 <= b <= 0xbf or 0xd9 <= b <= 0xdb:
        return _skip_str(r)
    else:
        return _skip_sized(r, b)
    if items < 0:
        return False
    for i in range(items):
        if not _skip(r, depth + 1):
            return False
    return True


cdef bint _skip_str(_Reader* r):
    cdef const unsigned char* s
    cdef Py_ssize_t length
    return _str(r, &s, &length)


cdef bint _skip_sized(_Reader* r, unsigned char b):
    """Step over a number, a bin or an ext (everything ``_skip`` does not nest into)."""
    cdef Py_ssize_t size, head = 1
    if 0xcc <= b <= 0xcf:
        size = 1 << (b - 0xcc)
    elif 0xd0 <= b <= 0xd3:
        size = 1 << (b - 0xd0)
    elif b == 0xca:
        size = 4
    elif b == 0xcb:
        size = 8
    elif 0xd4 <= b <= 0xd8:  # fixext 1/2/4/8/16: a type byte and the data
        size = 1 + (1 << (b - 0xd4))
    elif 0xc4 <= b <= 0xc6:  # bin 8/16/32
        head = 1 + (1 << (b - 0xc4))
        if r.pos + head > r.n:
            return False
        size = <Py_ssize_t>_be(r.p + r.pos + 1, head - 1)
    elif 0xc7 <= b <= 0xc9:  # ext 8/16/32: a length, a type byte, the data
        head = 1 + (1 << (b - 0xc7))
        if r.pos + head > r.n:
            return False
        size = <Py_ssize_t>_be(r.p + r.pos + 1, head - 1) + 1
    else:  # 0xc1: never used
        return False
    if size > r.n - r.pos - head:
        return False
    r.pos += head + size
    return True


# --- events -----------------------------------------------------------------------------------

# Field numbers: an array-encoded store's positions (0: the tag), which map keys name too.
cdef tuple _FIELD_NAMES = (
    b"type", b"block_hashes", b"parent_block_hash", b"token_ids", b"block_size", b"lora_id",
    b"medium", b"lora_name", b"extra_keys", b"group_idx", b"kv_cache_spec_kind",
    b"kv_cache_spec_sliding_window", b"locality", b"ownership", b"session_id",
    b"lookahead_token_ids")
# A removal's fields, in its array positions.
cdef int[5] _REMOVAL_FIELDS = [1, 6, 9, 12, 13]
cdef int _REMOVAL_MASK = (1 << 1) | (1 << 6) | (1 << 9) | (1 << 12) | (1 << 13)
cdef tuple _PLAIN_KIND_NAMES = tuple(k.encode() for k in PLAIN_KINDS if k is not None)
cdef uint64_t _MAX_BLOCK_SIZE = MAX_PLAIN_BLOCK_SIZE


cdef int _field_number(const unsigned char* s, Py_ssize_t length):
    cdef int i
    for i in range(len(_FIELD_NAMES)):
        if _is(s, length, <bytes>_FIELD_NAMES[i]):
            return i
    return -1


cdef bint _read_field(PlainBatch batch, _Reader* r, int field, _PlainEvent* e,
                      Py_ssize_t* extra) except -1:
    """Field ``field`` of the event into ``e`` (``extra``: how many extra keys, all nil,
    -1 for none); False when its value is not plain."""
    cdef Py_ssize_t count, i
    cdef uint64_t value
    cdef const unsigned char* s
    cdef Py_ssize_t length
    cdef object name
    cdef bint checked
    if field == 1 or field == 3:  # block hashes, token ids
        count = _header(r, 0x90, 0xdc)
        if count < 0:
            return False
        if count > _COPIED_ITEMS:  # checked, and left in the payload
            # The checks are most of a huge event's reading (a 300,000-block store: 10-25
            # ms): without the GIL, a reading on another thread leaves the loop running.
            if field == 1:
                e.blocks, e.hashes_at, e.hashes_read_at = count, r.pos, r.pos
                with nogil:
                    checked = _checked_hashes(r, count)
                return checked
            e.tokens, e.tokens_at, e.tokens_read_at = count, r.pos, r.pos
            with nogil:
                r.pos = _checked_tokens(r, count)
            return r.pos >= 0
        if field == 1:
            batch._room(count, 0)
            e.first_hash, e.blocks = batch.hashes_used, count
            for i in range(count):
                if not _uint(r, &batch.hashes[batch.hashes_used + i]):
                    return False
            batch.hashes_used += count
        else:
            batch._room(0, count)
            e.first_token, e.tokens = batch.tokens_used, count
            r.pos = _token_words(r.p, r.n, r.pos, count, &batch.tokens[batch.tokens_used])
            if r.pos < 0:
                return False
            batch.tokens_used += count
        return True
    if _nil(r):
        return field != 4  # every other field may be nil
    if field == 2:
        e.has_parent = _uint(r, &e.parent)
        return e.has_parent
    if field == 4:
        if not _uint(r, &value) or not 0 < value <= _MAX_BLOCK_SIZE:
            return False
        e.block_size = <Py_ssize_t>value
        return True
    if field == 6:
        return _str(r, &s, &length) and _is(s, length, b"GPU")
    if field == 8:
        count = _header(r, 0x90, 0xdc)
        if count < 0:
            return False
        for i in range(count):
            if not _nil(r):
                return False
        extra[0] = count
        return True
    if field == 9:
        return _uint(r, &value) and value == 0
    if field == 10:
        if not _str(r, &s, &length):
            return False
        for name in _PLAIN_KIND_NAMES:
            if _is(s, length, <bytes>name):
                return True
        return False
    if field == 11:
        return _uint(r, &value)
    # Anything else but nil is not taken: a LoRA id or name, and a locality, ownership or
    # session id (the decoder decodes those whatever they hold, so a string in them that is
    # not UTF-8 makes the event malformed; vLLM sends nil).
    return False


cdef bint _read_event(PlainBatch batch, _Reader* r, _PlainEvent* e) except -1:
    """One event, map- or array-encoded, into ``e``; False when it is not plain in form."""
    cdef const unsigned char* s
    cdef Py_ssize_t length, items, i
    cdef Py_ssize_t extra = -1
    cdef int field, allowed
    cdef int seen = 0  # the fields given, to refuse one given twice
    cdef bint as_map = r.pos < r.n and (0x80 <= r.p[r.pos] <= 0x8f or r.p[r.pos] in (0xde, 0xdf))
    e.kind, e.first_hash, e.blocks, e.has_parent = 0, batch.hashes_used, 0, False
    e.block_size, e.first_token, e.tokens = 0, batch.tokens_used, 0
    e.hashes_at = e.tokens_at = -1
    e.hashes_read = e.tokens_read = 0
    items = _header(r, 0x80, 0xde) if as_map else _header(r, 0x90, 0xdc)
    if items < 1:
        return False
    if as_map:  # the tag first: "type"
        if not _str(r, &s, &length) or not _is(s, length, b"type"):
            return False
    if not _str(r, &s, &length):
        return False
    if _is(s, length, b"BlockStored"):
        e.kind, allowed = _STORE, 0xFFFE
    elif _is(s, length, b"BlockRemoved"):
        e.kind, allowed = _REMOVAL, _REMOVAL_MASK
    else:
        return False
    for i in range(1, items):
        if as_map:
            if not _str(r, &s, &length):
                return False
            field = _field_number(s, length)
            if field < 0 or not (allowed >> field) & 1:  # unknown to this event: skipped
                if field == 0 or not _skip(r, 0):
                    return False
                continue
        elif e.kind == _STORE:
            if i > 14:
                return False
            field = i
        else:
            if i > 5:
                return False
            field = _REMOVAL_FIELDS[i - 1]
        if (seen >> field) & 1:
            return False
        seen |= 1 << field
        if not _read_field(batch, r, field, e, &extra):
            return False
    if not seen & (1 << 1):
        return False
    if e.kind == _REMOVAL:
        return True
    return (e.blocks >= 1 and e.block_size > 0 and e.tokens == e.blocks * e.block_size
            and (extra < 0 or extra == e.blocks))


cdef bint _read_ts(_Reader* r, double* ts):
    cdef unsigned char b
    cdef uint64_t bits
    cdef uint32_t bits32
    cdef double wide
    cdef float narrow
    if r.pos >= r.n:
        return False
    b = r.p[r.pos]
    if b == 0xcb and r.pos + 9 <= r.n:
        bits = _be(r.p + r.pos + 1, 8)
        memcpy(&wide, &bits, 8)
        ts[0] = wide
        r.pos += 9
        return True
    if b == 0xca and r.pos + 5 <= r.n:
        bits32 = <uint32_t>_be(r.p + r.pos + 1, 4)
        memcpy(&narrow, &bits32, 4)
        ts[0] = narrow
        r.pos += 5
        return True
    if _uint(r, &bits):
        ts[0] = <double>bits
        return True
    return False


def read_plain_batch(payload):
    """``payload`` (bytes, or any buffer: a big message's ZeroMQ frame is read in place) as
    a ``PlainBatch``, or None when it is anything but an array envelope ``[ts, events]`` or
    ``[ts, events, data_parallel_rank]`` of events all plain in form (module text above).
    The batch holds the payload's buffer while it lives."""
    cdef _Reader r
    cdef Py_ssize_t items, count, k
    cdef uint64_t rank
    cdef PlainBatch batch = PlainBatch.__new__(PlainBatch)
    PyObject_GetBuffer(payload, &batch.payload, PyBUF_SIMPLE)
    batch.has_payload = True
    r.p = <const unsigned char*>batch.payload.buf
    r.n = batch.payload.len
    r.pos = 0
    items = _header(&r, 0x90, 0xdc)
    if items < 2 or items > 3 or not _read_ts(&r, &batch.ts):
        return None
    count = _header(&r, 0x90, 0xdc)
    if count < 0:
        return None
    batch.events = <_PlainEvent*>malloc(max(count, 1) * sizeof(_PlainEvent))
    if batch.events is NULL:
        raise MemoryError()
    for k in range(count):
        if not _read_event(batch, &r, &batch.events[k]):
            return None
        batch.count = k + 1
    if items == 3 and not _nil(&r):
        if not _uint(&r, &rank):
            return None
        batch.data_parallel_rank = PyLong_FromUnsignedLongLong(rank)
    return batch if r.pos == r.n else None

# Included by _fast.pyx: the compiled index's two big containers.
#
# ``NodeMap`` (content key -> packed node value) and ``HandleMap`` (engine hash -> content
# key) stand in for the pure index's ``_nodes`` dict and each worker's ``handles`` dict. A
# dict entry costs a table slot, a key object and a value object (about 120 bytes for a
# node, 80 for a handle); here the common entry is one 24-byte record of three machine
# words, found through a table of 4-byte record numbers kept at most half full:
#
# - a record: NodeMap  [key word 0, key word 1, value]   (a 16-byte key, a value < 2**64)
#             HandleMap [engine hash, key word 0, key word 1]   (a hash < 2**64, a 16-byte key)
#   The key's bytes are copied as they are, so a key read back is byte for byte the one
#   stored.
# - records live in one array; a removed one has its value words zeroed (a value of all
#   zero bits is never kept in a record, so that marks it free) and goes on a free list
#   (chained through its first word), reused before the array grows; the array is compacted
#   when three quarters of it is free. Growing the slot table and compacting read the
#   records in array order, not in the slots' random order.
# - growing the slot table is spread over the additions that follow: the records are moved
#   into the new, twice as big table ``MOVE_STEP`` at a time, in array order, while the old
#   one still answers for those not yet moved (see ``_grow_slots``). Rebuilt at once, a table
#   stalled the caller that grew it for every entry it held, longer as the fleet grows.
# - ``slots``: open addressing with linear probing over record numbers + 1 (0 is empty);
#   removal shifts the probe run back, so there are no tombstones. A slot's low
#   ``number_bits`` bits hold the number: as many bits as records can number while that
#   slot table lasts (``_width_for``), so the width changes only with the slot table. The
#   4 bits above them say how far the slot lies past its home (15: that far or more, read
#   the record's key to know), so a removal shifts the run back without reading the
#   records of the slots it moves; the rest hold a tag, those bits of the key's hash, so a
#   probe reads a record only where the tags agree: a lookup that misses mostly reads no
#   record at all. The tags shrink as the table grows (6-7 bits at a million entries, 2-3
#   at 16M; past 134M the distance goes too).
#
# Anything else is kept in ``_other``, a plain dict: keys or values that do not fit (a
# node held by a worker past slot 35, whose holder bit is past bit 63; bytes engine hashes;
# a value of all zero bits).
# Invariant: a key is in at most one of the two. Both types answer the dict methods the
# index uses, so its pure-Python code runs on them unchanged; the loops in _fast.pyx use
# the C methods below and fall back to ``_other`` themselves.

import sys

from cpython.bytes cimport PyBytes_FromStringAndSize
from libc.stdint cimport uint32_t
from libc.stdlib cimport free, malloc, realloc


cdef extern from *:
    """
    #include <stdlib.h>
    #include <string.h>
    #include <sys/mman.h>

    /* The tables' arrays. One of KVROUTE_MAPPED_BYTES or more is mapped from the kernel:
       its pages are zero until first written, it is given back whole when freed, and it
       grows by remapping its pages (Linux) rather than by copying its bytes. A smaller
       one comes from malloc. Which kind an array is follows from its size alone, so the
       caller passes the size it allocated. */
    #define KVROUTE_MAPPED_BYTES ((size_t)1 << 20)

    static void* kvroute_array_new(size_t bytes, int zeroed) {
        void* p;
        if (bytes >= KVROUTE_MAPPED_BYTES) {
            p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
            return p == MAP_FAILED ? NULL : p;
        }
        if (bytes == 0)
            bytes = 1;
        return zeroed ? calloc(bytes, 1) : malloc(bytes);
    }

    static void kvroute_array_free(void* p, size_t bytes) {
        if (p == NULL)
            return;
        if (bytes >= KVROUTE_MAPPED_BYTES)
            munmap(p, bytes);
        else
            free(p);
    }

    /* ``p`` (``old_bytes``, NULL: none) as ``new_bytes`` (more), its bytes kept; NULL when
       there is no memory, ``p`` then untouched. */
    static void* kvroute_array_grow(void* p, size_t old_bytes, size_t new_bytes) {
        void* q;
        if (p == NULL)
            return kvroute_array_new(new_bytes, 0);
    #ifdef MREMAP_MAYMOVE
        if (old_bytes >= KVROUTE_MAPPED_BYTES) {
            q = mremap(p, old_bytes, new_bytes, MREMAP_MAYMOVE);
            return q == MAP_FAILED ? NULL : q;
        }
    #endif
        if (new_bytes < KVROUTE_MAPPED_BYTES)
            return realloc(p, new_bytes);
        q = kvroute_array_new(new_bytes, 0);
        if (q == NULL)
            return NULL;
        memcpy(q, p, old_bytes);
        kvroute_array_free(p, old_bytes);
        return q;
    }
    """
    void* kvroute_array_new(size_t bytes, int zeroed) nogil
    void kvroute_array_free(void* p, size_t bytes) nogil
    void* kvroute_array_grow(void* p, size_t old_bytes, size_t new_bytes) nogil
from libc.string cimport memcpy, memset
from cpython.long cimport PyLong_AsUnsignedLongLong


cdef struct Record:
    uint64_t w[3]


cdef inline uint64_t _mix(uint64_t x) noexcept nogil:
    """A 64-bit finalizer (murmur3's): engine hashes can be small consecutive ints."""
    x ^= x >> 33
    x *= 0xff51afd7ed558ccdULL
    x ^= x >> 33
    x *= 0xc4ceb9fe1a85ec53ULL
    x ^= x >> 33
    return x


cdef object _UINT64_END = 1 << 64
cdef object _MISSING = object()
DEF MIN_SLOTS = 8
# Records moved into a grown slot table per addition or removal: at least 4 (a table
# grows again once its count doubles; its records then number at most twice the old
# table's slots), and few enough that no call waits long.
DEF MOVE_STEP = 16
# A table of at most this many records is moved at once when its slots grow.
DEF MOVE_AT_ONCE = 256
# Records are compacted only past this many (``_after_removal``).
DEF COMPACT_FLOOR = 1024


cdef int _bits_for(uint64_t largest) noexcept nogil:
    """The bits a slot's number needs to hold every value up to ``largest`` (at most 32)."""
    cdef int bits = 0
    while bits < 32 and (<uint64_t>1 << bits) <= largest:
        bits += 1
    return bits


cdef inline int _width_for(Py_ssize_t slots, Py_ssize_t used) noexcept nogil:
    """The number width of a new slot table of ``slots`` slots, made when ``used`` records
    are handed out. While that table lasts, records number at most the larger of ``used +
    used // MOVE_STEP + 1`` and ``slots // 2 + 1``: an addition takes a new record only
    when no freed one waits (then every record is live, and entries fill at most half the
    slots) or while the table is filled (``_move_some``: each addition moves ``MOVE_STEP``
    records, and freed ones are not reused meanwhile)."""
    return _bits_for(max(<uint64_t>(used + used // MOVE_STEP + 1), <uint64_t>(slots // 2 + 1)))


cdef class _Table:
    """The record array and its slot table; ``key_words`` (1 or 2) of each record's three
    words are its key. Subclasses say how Python keys and values map onto the words."""

    cdef Record* records
    cdef uint32_t* slots
    cdef Py_ssize_t mask  # slots - 1 (a power of two minus one)
    cdef Py_ssize_t count  # live records
    cdef Py_ssize_t used  # records handed out (live + free)
    cdef Py_ssize_t capacity  # records allocated
    cdef Py_ssize_t free_head  # record number + 1 of the first free one, 0: none
    cdef int key_words
    cdef int number_bits  # a slot's low bits that hold its record number + 1
    cdef uint32_t number_mask  # (1 << number_bits) - 1
    cdef uint32_t far  # the distance field's largest value, "this far or more" (0: none)
    cdef uint32_t distance_mask  # the distance field in place: far << number_bits
    cdef uint32_t tag_mask  # the bits above both: the tag
    # While a grown slot table is filled: the one before it (NULL otherwise), its mask and
    # its slots' number and tag masks. Records below ``moved`` are in ``slots`` (if live);
    # live ones in [moved, move_end) are in ``old_slots`` only; records from ``move_end``
    # on were added meanwhile, into ``slots``. ``old_slots`` is only read: a record removed
    # before it is moved is freed (and not reused until the move ends), and a lookup there
    # takes a slot only if its record is live, not yet moved and holds the key.
    cdef uint32_t* old_slots
    cdef Py_ssize_t old_mask
    cdef uint32_t old_number_mask
    cdef uint32_t old_tag_mask
    cdef Py_ssize_t moved
    cdef Py_ssize_t move_end
    cdef public dict _other

    def __cinit__(self):
        self.slots = <uint32_t*>kvroute_array_new(MIN_SLOTS * sizeof(uint32_t), 1)
        if self.slots is NULL:
            raise MemoryError()
        self.mask = MIN_SLOTS - 1
        self.records = NULL
        self.old_slots = NULL
        self._set_widths(_width_for(MIN_SLOTS, 0))
        self._other = {}

    def __dealloc__(self):
        kvroute_array_free(self.records, self.capacity * sizeof(Record))
        kvroute_array_free(self.slots, (self.mask + 1) * sizeof(uint32_t))
        kvroute_array_free(self.old_slots, (self.old_mask + 1) * sizeof(uint32_t))

    # --- C level ----------------------------------------------------------------------------

    cdef inline uint64_t _hash(self, const uint64_t* key) noexcept nogil:
        if self.key_words == 2:
            return _mix(key[0] ^ (key[1] * 0x9e3779b97f4a7c15ULL))
        return _mix(key[0])

    cdef inline Py_ssize_t _home(self, const uint64_t* key) noexcept nogil:
        return <Py_ssize_t>(self._hash(key) & self.mask)

    cdef inline uint32_t _tag(self, uint64_t h) noexcept nogil:
        """A slot's tag bits for hash ``h``: its high bits (the home is its low ones)."""
        return <uint32_t>(h >> 32) & self.tag_mask

    cdef inline uint32_t _distance(self, Py_ssize_t d) noexcept nogil:
        """The distance field for a slot ``d`` past its home."""
        if <uint64_t>d > self.far:
            d = self.far
        return <uint32_t>((<uint64_t>d) << self.number_bits)

    cdef void _set_widths(self, int bits) noexcept:
        """Slots with ``bits`` bits of record number (the slots are the caller's to place)."""
        self.number_bits = bits
        self.number_mask = <uint32_t>((<uint64_t>1 << bits) - 1)
        self.far = 15 if bits <= 28 else 0
        self.distance_mask = <uint32_t>((<uint64_t>self.far) << bits)
        self.tag_mask = ~(self.number_mask | self.distance_mask)

    cdef inline bint _same(self, const Record* r, const uint64_t* key) noexcept nogil:
        return r.w[0] == key[0] and (self.key_words == 1 or r.w[1] == key[1])

    cdef inline bint _live(self, const Record* r) noexcept nogil:
        return r.w[2] != 0 or (self.key_words == 1 and r.w[1] != 0)

    cdef inline void _place(self, uint32_t* slots, Py_ssize_t number) noexcept nogil:
        """Put record ``number`` in the first free slot of its probe run in ``slots``."""
        cdef uint64_t h = self._hash(self.records[number].w)
        cdef Py_ssize_t home = <Py_ssize_t>(h & self.mask)
        cdef Py_ssize_t i = home
        while slots[i]:
            i = (i + 1) & self.mask
        slots[i] = (self._tag(h) | self._distance((i - home) & self.mask)
                    | <uint32_t>(number + 1))

    cdef Py_ssize_t _slot(self, const uint64_t* key) noexcept nogil:
        """The slot holding ``key``'s record, or -1."""
        cdef uint64_t h = self._hash(key)
        cdef Py_ssize_t i = <Py_ssize_t>(h & self.mask)
        cdef uint32_t tag = self._tag(h)
        cdef uint32_t s
        while True:
            s = self.slots[i]
            if s == 0:
                return -1
            if (s & self.tag_mask) == tag and self._same(
                    &self.records[(s & self.number_mask) - 1], key):
                return i
            i = (i + 1) & self.mask

    cdef Py_ssize_t _old_number(self, const uint64_t* key) noexcept nogil:
        """The number of ``key``'s record if it waits in ``old_slots`` to be moved, or -1."""
        cdef uint64_t h
        cdef Py_ssize_t i, number
        cdef uint32_t tag, s
        if self.old_slots is NULL:
            return -1
        h = self._hash(key)
        i = <Py_ssize_t>(h & self.old_mask)
        tag = <uint32_t>(h >> 32) & self.old_tag_mask
        while True:
            s = self.old_slots[i]
            if s == 0:
                return -1
            if (s & self.old_tag_mask) == tag:
                number = (s & self.old_number_mask) - 1
                if (number >= self.moved and self._live(&self.records[number])
                        and self._same(&self.records[number], key)):
                    return number
            i = (i + 1) & self.old_mask

    cdef inline void prefetch(self, const uint64_t* key) noexcept nogil:
        """Start fetching the slot ``key`` is looked up from (a hint; nothing changes)."""
        kvroute_prefetch(&self.slots[self._home(key)])
        if self.old_slots is not NULL:
            self._prefetch_old(key)

    cdef void _prefetch_old(self, const uint64_t* key) noexcept nogil:
        kvroute_prefetch(&self.old_slots[<Py_ssize_t>(self._hash(key) & self.old_mask)])

    cdef inline Record* find(self, const uint64_t* key) noexcept nogil:
        """``key``'s record in the array, or NULL (``_other`` not looked at)."""
        cdef Py_ssize_t i = self._slot(key)
        if i >= 0:
            return &self.records[(self.slots[i] & self.number_mask) - 1]
        return NULL if self.old_slots is NULL else self._find_old(key)

    cdef Record* _find_old(self, const uint64_t* key) noexcept nogil:
        cdef Py_ssize_t number = self._old_number(key)
        return NULL if number < 0 else &self.records[number]

    cdef Record* add(self, const uint64_t* key) except NULL:
        """A new record for ``key``, which the caller knows is in neither part: its key
        words are set, the rest is for the caller. Valid until the next add or remove."""
        cdef Py_ssize_t number, i
        cdef Record* r
        if 2 * (self.count + 1) > self.mask + 1:
            self._grow_slots()
        if self.free_head and self.old_slots is NULL:
            number = self.free_head - 1
            self.free_head = <Py_ssize_t>self.records[number].w[0]
        else:
            if self.used == self.capacity:
                self._grow_records(self.capacity + self.capacity // 2 + 4)
            number = self.used
            if <uint64_t>number + 1 > self.number_mask:  # past _width_for's bound: never so far
                self._finish_move()
                self._set_widths(_bits_for(<uint64_t>number + 1))
                self._place_all(self.slots)  # before ``used`` counts the new record
            self.used += 1
        r = &self.records[number]
        r.w[0] = key[0]
        if self.key_words == 2:
            r.w[1] = key[1]
        self._place(self.slots, number)
        self.count += 1
        if self.old_slots is not NULL:
            self._move_some()
        return r

    cdef int _grow_slots(self) except -1:
        """Twice the slots. The records are placed in the new table a few at a time by the
        calls that follow (``_move_some``), the old table answering meanwhile for those not
        yet moved, unless there are few."""
        cdef Py_ssize_t size = 2 * (self.mask + 1)
        cdef uint32_t* fresh
        self._finish_move()
        if self.used <= MOVE_AT_ONCE:
            self._resize_slots(size)
            return 0
        fresh = <uint32_t*>kvroute_array_new(size * sizeof(uint32_t), 1)
        if fresh is NULL:
            raise MemoryError()
        self.old_slots = self.slots
        self.old_mask = self.mask
        self.old_number_mask = self.number_mask
        self.old_tag_mask = self.tag_mask
        self.slots = fresh
        self.mask = size - 1
        self._set_widths(_width_for(size, self.used))
        self.moved = 0
        self.move_end = self.used
        return 0

    cdef void _move_some(self) noexcept:
        """Place the next ``MOVE_STEP`` records waiting to be moved (their new slots fetched
        first), and let the old table go once none waits."""
        cdef Py_ssize_t number
        cdef Py_ssize_t end = min(self.moved + MOVE_STEP, self.move_end)
        for number in range(self.moved, end):
            kvroute_prefetch(&self.slots[self._home(self.records[number].w)])
        for number in range(self.moved, end):
            if self._live(&self.records[number]):
                self._place(self.slots, number)
        self.moved = end
        if end == self.move_end:
            kvroute_array_free(self.old_slots, (self.old_mask + 1) * sizeof(uint32_t))
            self.old_slots = NULL

    cdef void _finish_move(self) noexcept:
        """Move every record still waiting (before anything that renumbers records or
        replaces the slot table again)."""
        while self.old_slots is not NULL:
            self._move_some()

    cdef int remove(self, const uint64_t* key) except -1:
        """Forget ``key``'s record; 0 when there was none."""
        cdef Py_ssize_t i = self._slot(key)
        if i >= 0:
            self._remove_slot(i)
            return 1
        i = self._old_number(key)
        if i < 0:
            return 0
        self._free(i)  # its old slot stays; lookups there pass over a freed record
        self._after_removal()
        return 1

    cdef inline void _free(self, Py_ssize_t number) noexcept:
        self.records[number].w[0] = <uint64_t>self.free_head
        self.records[number].w[1] = self.records[number].w[2] = 0  # free (and its key is gone)
        self.free_head = number + 1
        self.count -= 1

    cdef int _remove_slot(self, Py_ssize_t i) except -1:
        cdef Py_ssize_t number = (self.slots[i] & self.number_mask) - 1
        cdef Py_ssize_t j = i
        cdef Py_ssize_t gap, d
        cdef uint32_t s
        self._free(number)
        while True:  # shift the rest of the probe run back over the hole at i
            j = (j + 1) & self.mask
            s = self.slots[j]
            if s == 0:
                break
            d = <Py_ssize_t>((<uint64_t>s >> self.number_bits) & self.far)
            if d >= self.far:  # that far or more: the record's key says how far
                d = (j - self._home(self.records[(s & self.number_mask) - 1].w)) & self.mask
            # Stays where it is when its home lies cyclically in (i, j].
            gap = (j - i) & self.mask
            if d < gap:
                continue
            self.slots[i] = (s & ~self.distance_mask) | self._distance(d - gap)
            i = j
        self.slots[i] = 0
        return self._after_removal()

    cdef int _after_removal(self) except -1:
        """Take the move a step on, as an addition does; let memory go once the table is
        empty, mostly freed records or mostly empty slots."""
        if self.old_slots is not NULL:
            self._move_some()
        if self.count == 0:
            self._reset()
        elif 4 * self.count < self.used and self.used > COMPACT_FLOOR:
            self._finish_move()
            self._compact()
        elif 8 * self.count < self.mask + 1 and self.mask + 1 > MIN_SLOTS:
            self._finish_move()
            self._resize_slots((self.mask + 1) // 2)
        return 0

    cdef int _resize_slots(self, Py_ssize_t size) except -1:
        """A table of ``size`` slots, every record placed in it at once."""
        cdef uint32_t* fresh = <uint32_t*>kvroute_array_new(size * sizeof(uint32_t), 0)
        if fresh is NULL:
            raise MemoryError()
        kvroute_array_free(self.slots, (self.mask + 1) * sizeof(uint32_t))
        self.slots = fresh
        self.mask = size - 1
        self._set_widths(_width_for(size, self.used))
        self._place_all(fresh)
        return 0

    cdef int _grow_records(self, Py_ssize_t capacity) except -1:
        if capacity >= 0xFFFFFFFF:
            raise MemoryError("a table of more than 2**32 - 1 entries")
        cdef Record* grown = <Record*>kvroute_array_grow(
            self.records, self.capacity * sizeof(Record), capacity * sizeof(Record))
        if grown is NULL:
            raise MemoryError()
        self.records = grown
        self.capacity = capacity
        return 0

    cdef void _place_all(self, uint32_t* slots) noexcept:
        """Every live record placed afresh in ``slots`` (``mask + 1`` of them, emptied here)."""
        cdef Py_ssize_t number
        memset(slots, 0, (self.mask + 1) * sizeof(uint32_t))
        for number in range(self.used):
            if self._live(&self.records[number]):
                self._place(slots, number)

    cdef int _compact(self) except -1:
        """Move the live records to the front of a new array of about their size."""
        cdef Py_ssize_t capacity = self.count + self.count // 2 + 4
        cdef Record* fresh = <Record*>kvroute_array_new(capacity * sizeof(Record), 0)
        cdef Py_ssize_t k, n = 0
        if fresh is NULL:
            raise MemoryError()
        for k in range(self.used):
            if self._live(&self.records[k]):
                fresh[n] = self.records[k]
                n += 1
        kvroute_array_free(self.records, self.capacity * sizeof(Record))
        self.records = fresh
        self.capacity = capacity
        self.used = n
        self.free_head = 0
        self._set_widths(_width_for(self.mask + 1, self.used))
        self._place_all(self.slots)
        return 0

    cdef void _reset(self) noexcept:
        kvroute_array_free(self.records, self.capacity * sizeof(Record))
        self.records = NULL
        kvroute_array_free(self.old_slots, (self.old_mask + 1) * sizeof(uint32_t))
        self.old_slots = NULL
        self.capacity = self.used = self.free_head = self.count = 0
        if self.mask + 1 > MIN_SLOTS:
            kvroute_array_free(self.slots, (self.mask + 1) * sizeof(uint32_t))
            self.slots = <uint32_t*>kvroute_array_new(MIN_SLOTS * sizeof(uint32_t), 0)
            self.mask = MIN_SLOTS - 1
        self._set_widths(_width_for(self.mask + 1, 0))
        memset(self.slots, 0, (self.mask + 1) * sizeof(uint32_t))

    cdef int _copy_into(self, _Table other) except -1:
        self._finish_move()
        other._reset()
        kvroute_array_free(other.slots, (other.mask + 1) * sizeof(uint32_t))
        other.slots = <uint32_t*>kvroute_array_new((self.mask + 1) * sizeof(uint32_t), 0)
        other.mask = self.mask
        if other.slots is NULL:
            other.mask = MIN_SLOTS - 1  # nothing to free; __dealloc__ frees NULL
            raise MemoryError()
        if self.used:
            other._grow_records(self.used)
            memcpy(other.records, self.records, self.used * sizeof(Record))
        # The slots as they are here, numbers and tags: this width fits the copy's records.
        memcpy(other.slots, self.slots, (self.mask + 1) * sizeof(uint32_t))
        other._set_widths(self.number_bits)
        other.used = self.used
        other.count = self.count
        other.free_head = self.free_head
        other._other = dict(self._other)
        return 0

    # --- conversions (subclasses) -----------------------------------------------------------

    cdef bint _pack_key(self, object key, uint64_t* words) except -1:
        raise NotImplementedError

    cdef bint _pack_value(self, object value, uint64_t* words) except -1:
        raise NotImplementedError

    cdef object _key(self, const Record* r):
        raise NotImplementedError

    cdef object _value(self, const Record* r):
        raise NotImplementedError

    # --- the dict methods the index uses -----------------------------------------------------

    def __len__(self):
        return self.count + len(self._other)

    def __contains__(self, key):
        cdef uint64_t words[3]
        if self._pack_key(key, words) and self.find(words) is not NULL:
            return True
        return bool(self._other) and key in self._other

    def __getitem__(self, key):
        cdef uint64_t words[3]
        cdef Record* r
        if self._pack_key(key, words):
            r = self.find(words)
            if r is not NULL:
                return self._value(r)
        return self._other[key]

    def get(self, key, default=None):
        cdef uint64_t words[3]
        cdef Record* r
        if self._pack_key(key, words):
            r = self.find(words)
            if r is not NULL:
                return self._value(r)
        return self._other.get(key, default) if self._other else default

    def __setitem__(self, key, value):
        cdef uint64_t words[3]
        cdef Record* r
        if self._pack_key(key, words):
            if self._pack_value(value, words):
                if self._other:
                    self._other.pop(key, None)
                r = self.find(words)
                if r is NULL:
                    r = self.add(words)
                memcpy(&r.w[self.key_words], &words[self.key_words],
                       (3 - self.key_words) * sizeof(uint64_t))
                return
            self.remove(words)
        self._other[key] = value

    def __delitem__(self, key):
        cdef uint64_t words[3]
        if self._pack_key(key, words) and self.remove(words):
            return
        del self._other[key]

    def setdefault(self, key, default=None):
        value = self.get(key, _MISSING)
        if value is _MISSING:
            self[key] = default
            return default
        return value

    def pop(self, key, default=_MISSING):
        value = self.get(key, _MISSING)
        if value is _MISSING:
            if default is _MISSING:
                raise KeyError(key)
            return default
        del self[key]
        return value

    def popitem(self):
        cdef Py_ssize_t number
        cdef Record* r
        if self._other:
            return self._other.popitem()
        if not self.count:
            raise KeyError("popitem(): the table is empty")
        number = self.used - 1
        while not self._live(&self.records[number]):
            number -= 1
        r = &self.records[number]
        item = (self._key(r), self._value(r))
        self.remove(r.w)
        return item

    def clear(self):
        self._reset()
        self._other = {}

    def keys(self):
        """The keys, as a list (a snapshot: the table may change while it is walked), in
        the records' order, then ``_other``'s."""
        cdef list out = []
        cdef Py_ssize_t k
        for k in range(self.used):
            if self._live(&self.records[k]):
                out.append(self._key(&self.records[k]))
        out.extend(self._other)
        return out

    def values(self):
        """The values, as a list (a snapshot), in the order of ``keys()``."""
        cdef list out = []
        cdef Py_ssize_t k
        for k in range(self.used):
            if self._live(&self.records[k]):
                out.append(self._value(&self.records[k]))
        out.extend(self._other.values())
        return out

    def items(self):
        """The (key, value) pairs, as a list (a snapshot), in the order of ``keys()``."""
        cdef list out = []
        cdef Py_ssize_t k
        cdef Record* r
        for k in range(self.used):
            r = &self.records[k]
            if self._live(r):
                out.append((self._key(r), self._value(r)))
        out.extend(self._other.items())
        return out

    def __iter__(self):
        return iter(self.keys())

    def check_slots(self):
        """Raise AssertionError unless the slots hold exactly the live records: each
        slot of ``slots`` names a live record, none twice, with its key's tag and its true
        distance from its home, and no empty slot in between; each live record is in
        ``slots`` or, while a move waits for it, found through ``old_slots``. (Tests.)"""
        cdef Py_ssize_t i, j, number, home, live = 0
        cdef uint32_t s
        cdef bytearray placed = bytearray(self.used)
        for i in range(self.mask + 1):
            s = self.slots[i]
            if s == 0:
                continue
            number = (s & self.number_mask) - 1
            assert 0 <= number < self.used, f"slot {i} names record {number}"
            assert self._live(&self.records[number]), f"slot {i} names a freed record"
            assert not placed[number], f"record {number} in two slots"
            placed[number] = 1
            home = self._home(self.records[number].w)
            j = home
            while j != i:
                assert self.slots[j] != 0, f"an empty slot between record {number}'s home and it"
                j = (j + 1) & self.mask
            assert (s & self.tag_mask) == self._tag(self._hash(self.records[number].w))
            assert (s & self.distance_mask) == self._distance((i - home) & self.mask)
        for number in range(self.used):
            if not self._live(&self.records[number]):
                continue
            live += 1
            if self.old_slots is not NULL and self.moved <= number < self.move_end:
                assert not placed[number], f"record {number} placed before it was moved"
                assert self._old_number(self.records[number].w) == number
            else:
                assert placed[number], f"live record {number} in no slot"
        assert live == self.count, f"{live} live records, {self.count} counted"

    @property
    def moving(self):
        """Whether a grown slot table is still being filled (the old one answers too)."""
        return self.old_slots is not NULL

    def copy(self):
        fresh = type(self)()
        self._copy_into(fresh)
        return fresh

    def __deepcopy__(self, memo):
        return self.copy()  # keys and values are immutable

    def __reduce__(self):
        return type(self)._from_items, (self.items(),)

    @classmethod
    def _from_items(cls, items):
        table = cls()
        for key, value in items:
            table[key] = value
        return table

    def __eq__(self, other):
        if isinstance(other, (_Table, dict)):
            return dict(self.items()) == dict(other.items())
        return NotImplemented

    def __sizeof__(self):
        return (sizeof(Record) * self.capacity + sizeof(uint32_t) * (self.mask + 1)
                + (0 if self.old_slots is NULL else sizeof(uint32_t) * (self.old_mask + 1))
                + sys.getsizeof(self._other) + object.__sizeof__(self))

    def __repr__(self):
        return f"{type(self).__name__}({dict(self.items())!r})"


cdef class NodeMap(_Table):
    """Content key (16 bytes) -> node value (an int; below 2**64 in the record)."""

    def __cinit__(self):
        self.key_words = 2

    cdef bint _pack_key(self, object key, uint64_t* words) except -1:
        if type(key) is not bytes or PyBytes_GET_SIZE(key) != 16:
            return False
        memcpy(words, PyBytes_AS_STRING(key), 16)
        return True

    cdef bint _pack_value(self, object value, uint64_t* words) except -1:
        if type(value) is not int:
            return False
        try:
            words[2] = PyLong_AsUnsignedLongLong(value)
        except OverflowError:  # negative, or past 64 bits
            return False
        return words[2] != 0  # zero marks a free record

    cdef object _key(self, const Record* r):
        return PyBytes_FromStringAndSize(<const char*>r.w, 16)

    cdef object _value(self, const Record* r):
        return PyLong_FromUnsignedLongLong(r.w[2])


cdef class HandleMap(_Table):
    """Engine hash (an int below 2**64 in the record) -> content key (16 bytes)."""

    def __cinit__(self):
        self.key_words = 1

    cdef bint _pack_key(self, object key, uint64_t* words) except -1:
        if type(key) is not int:
            return False
        try:
            words[0] = PyLong_AsUnsignedLongLong(key)
        except OverflowError:  # negative, or past 64 bits
            return False
        return True

    cdef bint _pack_value(self, object value, uint64_t* words) except -1:
        if type(value) is not bytes or PyBytes_GET_SIZE(value) != 16:
            return False
        memcpy(&words[1], PyBytes_AS_STRING(value), 16)
        return (words[1] | words[2]) != 0  # zero marks a free record

    cdef object _key(self, const Record* r):
        return PyLong_FromUnsignedLongLong(r.w[0])

    cdef object _value(self, const Record* r):
        return PyBytes_FromStringAndSize(<const char*>&r.w[1], 16)

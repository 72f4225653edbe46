# cython: language_level=3, boundscheck=False, wraparound=False
"""A subscriber's live messages taken in one call while they are the plain common case: the
compiled half of ``BatchApplier.drain``.

``drain`` receives from a SUB socket through pyzmq's Cython API (``cimport zmq``: the
``Socket.recv`` its declarations publish for direct Cython calls, and ``Frame.more``), and
applies each message that is the next batch in order, read whole by the index
(``read_plain_batch``) and applied whole by one run (``apply_run``), as the subscriber's
Python path would: the same calls with the same bounds. It stops at the first message that
is anything else and hands it back, as frames, with what was done to it; the caller goes on
with it through the Python path. So nothing it takes differs from what that path does, and
what it does not take reaches that path unchanged.

Building it needs libzmq's header (``zmq.h``, Debian's libzmq3-dev) for the layout of
pyzmq's ``Frame``; a build without it leaves this module out and every message goes by the
Python path (``app.ingest.sockets.LoopSocket.recv``, which it mirrors).
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from libc.stdint cimport uint64_t
from zmq cimport Frame, Socket

import zmq

from kvroute.app.ingest.sequence import is_next

cdef extern from "<sys/epoll.h>" nogil:
    cdef struct epoll_event:
        unsigned int events
    int epoll_wait(int epfd, epoll_event* events, int maxevents, int timeout)

cdef extern from "<time.h>" nogil:
    ctypedef long time_t
    cdef struct timespec:
        time_t tv_sec
        long tv_nsec
    int clock_gettime(int clock, timespec* ts)
    int CLOCK_MONOTONIC

cdef int _DONTWAIT = zmq.DONTWAIT
DEF _SEQ_BYTES = 8  # app.ingest.wire.decode_seq's frame: an unsigned big-endian int


cdef inline double _now() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9


cdef object _copied(Frame frame):
    """A small frame's bytes, copied out of ZeroMQ's message."""
    cdef Py_buffer view
    PyObject_GetBuffer(frame, &view, PyBUF_SIMPLE)
    try:
        return PyBytes_FromStringAndSize(<const char*>view.buf, view.len)
    finally:
        PyBuffer_Release(&view)


cdef list _receive(Socket socket, Py_ssize_t big):
    """The next message's frames (bytes; a frame over ``big`` bytes as a read-only
    memoryview of ZeroMQ's message, as ``LoopSocket.recv`` hands it over), or None when none
    is queued. A message's frames arrive together, so the rest is there once one is."""
    cdef list frames
    cdef Frame frame
    try:
        frame = socket.recv(_DONTWAIT, False)
    except zmq.Again:
        return None
    frames = []
    while True:
        if len(frame) > big:
            frames.append(memoryview(frame).toreadonly())
        else:
            frames.append(_copied(frame))
        if not frame.more:
            return frames
        frame = socket.recv(_DONTWAIT, False)


cdef class Drained:
    """What one ``drain`` call did: ``taken`` messages applied whole (``events``, ``blocks``
    among them; the last one's ``seq`` and ``payload``), the work done since its last look
    at the clock (``unyielded`` events, ``unyielded_work`` blocks), and
    the message it stopped at, if any (``frames``), with the reading and run it began on it
    (``plain``, ``run``: None when nothing of it was applied). ``bounded``: it stopped,
    before receiving, at the turn's deadline or for a waiting request
    (``requests_waiting``). The caller yields, then drains on."""

    cdef public Py_ssize_t taken, events, blocks, unyielded, unyielded_work
    cdef public object seq, payload, frames, plain, run
    cdef public bint empty, requests_waiting, bounded

    def __init__(self):
        self.taken = self.events = self.blocks = 0
        self.seq = self.payload = self.frames = self.plain = self.run = None
        self.empty = self.requests_waiting = self.bounded = False


cdef class LiveTake:
    """One worker's compiled take of live messages: its index and worker, the bounds of a
    run (``limits``; ``chunk_events`` events and ``slice_blocks`` blocks of work), the
    largest payload it reads (``whole_bytes``) and the frame size over which a frame is
    left in place (``big``). Made once per ``BatchApplier``."""

    cdef object index, worker, limits
    cdef Py_ssize_t chunk_events, slice_blocks, whole_bytes, big

    def __init__(self, index, worker, limits, Py_ssize_t chunk_events,
                 Py_ssize_t slice_blocks, Py_ssize_t whole_bytes, Py_ssize_t big):
        self.index, self.worker, self.limits = index, worker, limits
        self.chunk_events, self.slice_blocks = chunk_events, slice_blocks
        self.whole_bytes, self.big = whole_bytes, big

    def drain(self, Socket socket, object last_seq, object last_live, object rank,
              Py_ssize_t limit, double deadline, int arrivals, double look,
              Py_ssize_t unyielded, Py_ssize_t unyielded_work):
        """Apply queued live messages while each is the next batch (``last_seq + 1``, above
        ``last_live``), its payload (at most ``whole_bytes``) reads as plain with the
        endpoint's ``rank`` (or none), and one run applies it whole within ``chunk_events``
        events and ``slice_blocks`` blocks of work since the last look at the clock (for the
        first message, the caller's ``unyielded`` events and ``unyielded_work`` blocks count).
        Takes at most ``limit``. Before each message it looks at the clock: it stops at
        ``deadline`` (``time.perf_counter``'s clock) or when the epoll descriptor ``arrivals``
        (-1: none) is ready, looked at every ``look`` seconds (a request waits:
        ``app.ingest.budget``), or when the caller's work left no room for an event; these are
        ``bounded``. It stops too when nothing is queued (``empty``), or at a message that is
        anything else: that one is handed back in ``Drained``.

        So the events and blocks bound each message's run, not the sum since the last yield as
        on the Python path (``BatchApplier.apply``): the drain needs no yield to look at the
        turn's clock or for a waiting request, and one yield (a pass of the event loop and a
        wake-up of the subscriber's task) cost about as much as applying a small batch."""
        cdef Drained done = Drained()
        cdef list frames
        cdef bytes seq_frame, payload
        cdef const unsigned char* p
        cdef uint64_t seq
        cdef Py_ssize_t count, i
        cdef double now, next_look = 0.0
        cdef epoll_event ready
        cdef Py_ssize_t chunk_events = self.chunk_events, slice_blocks = self.slice_blocks
        cdef Py_ssize_t whole_bytes = self.whole_bytes, big = self.big
        done.unyielded = unyielded
        done.unyielded_work = unyielded_work
        done.seq = last_seq
        if last_seq is None:
            return done
        worker, limits = self.worker, self.limits
        read = self.index.read_plain_batch
        apply_run = self.index.apply_run
        while done.taken < limit:
            now = _now()
            if now >= deadline or unyielded + 1 >= chunk_events:
                done.bounded = True
                break
            if arrivals >= 0 and now >= next_look:
                next_look = now + look
                if epoll_wait(arrivals, &ready, 1, 0) > 0:
                    done.requests_waiting = done.bounded = True
                    break
            frames = _receive(socket, big)
            if frames is None:
                done.empty = True
                break
            if len(frames) != 3 or type(frames[1]) is not bytes or type(frames[2]) is not bytes:
                done.frames = frames
                break
            seq_frame = frames[1]
            payload = frames[2]
            if PyBytes_GET_SIZE(seq_frame) != _SEQ_BYTES or PyBytes_GET_SIZE(payload) > whole_bytes:
                done.frames = frames
                break
            p = <const unsigned char*>PyBytes_AS_STRING(seq_frame)
            seq = 0
            for i in range(_SEQ_BYTES):
                seq = (seq << 8) | p[i]
            if not is_next(seq, done.seq, last_live):
                done.frames = frames
                break
            plain = read(payload)
            if plain is None or (plain.data_parallel_rank is not None
                                 and plain.data_parallel_rank != rank):
                done.frames = frames
                break
            count = len(plain)
            run = apply_run(worker, plain, 0, slice_blocks - unyielded_work,
                            chunk_events - unyielded - 1, limits)
            done.unyielded = unyielded + 1 + run.next
            done.unyielded_work = unyielded_work + run.work
            if run.next < count or run.error is not None or run.full:
                done.frames, done.plain, done.run = frames, plain, run
                break
            done.taken += 1
            done.events += count
            done.blocks += run.blocks
            done.seq = seq
            last_live = seq
            done.payload = payload
            unyielded = unyielded_work = 0  # the clock is looked at before the next one
        return done

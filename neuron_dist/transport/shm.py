"""Shared-memory transport for ranks on one host: bounded slot rings in /dev/shm, futex wake-ups.

Layout. Every rank owns one segment holding its *inbound* rings, one per local peer, plus a
control block (a futex doorbell, a "sleeping" flag, a closed flag, its pid, a "group failed" flag):

    [control 64 B][ring from peer a: head 64 B | tail 64 B | slot 0 .. slot S-1][ring from peer b ...]
    slot = [frame header 64 B][payload slot_bytes]

A sender copies a frame into the next free slot of its ring in the receiver's segment and
publishes it by bumping `head` (8-byte aligned stores are atomic, and x86-64 keeps store
order, so the payload is visible before the head: plain stores and loads, no barriers, which is
why `available` refuses other machines). The receiver hands the executor a
tensor *view of the slot*, typed as the frame's dtype: reductions read the peer's bytes in
place, with no extra copy, and `release` bumps `tail`, freeing the slot. Memory is bounded: S
slots (NEURON_DIST_SHM_SLOTS, default 4) of one frame each (NEURON_DIST_FRAME_BYTES, default
512 KiB, rounded up to whole 64-byte lines so every slot is aligned for any dtype) per peer
pair; a full ring makes `send` return False (the executor retries after `wait`).

Waiting. `wait` spins briefly (NEURON_DIST_SHM_SPIN_US: 50 us with a core per rank; 20 us of
sched_yield when local ranks outnumber cores, so the peer we wait for gets the core), with a core
per rank spins on yielding at each turn (NEURON_DIST_SHM_YIELD_US, 1000 us: a futex wake-up
costs more than a short wait), once per episode of waiting, and then sleeps on the doorbell with
futex(2); a peer that publishes a frame or frees a slot bumps the doorbell and wakes the sleeper
only when its "sleeping" flag is set. A full fence between the bump and the flag's read (`ring`)
keeps store/load reordering from losing a wake-up, so a rank that waits long sleeps until news
or its caller's time-out (each sleep capped at MAX_SLEEP, a safety net), not in 1 ms naps that
took ~4% of a core per waiting rank and slowed the peer it waited for.

Lending. For the collectives that only move data, the steps of others marked `lend` in their
schedules (those that only copy; those their receiver reduces, from `lend_reduce_from`), and
point-to-point messages larger than the
ring (`eager_bytes`), the executor may `lend` a frame instead of sending it (see `cma.py`): the
slot then holds the header and, in the slot header's last 8 bytes, the address of the sender's
bytes; the receiver gets a `cma.Lent` from `recv` and reads them straight into place. The sender
keeps the memory until the receiver releases the slot (`released` says when, per ticket; the
release rings the sender). A lent frame may be larger than a slot (up to `lend_bytes`).
Lending is on only when every pair of the transport's ranks passed a read probe at set-up and
none set NEURON_DIST_SHM_LEND=0, so every rank cuts those messages into the same frames.

Hygiene. Segments are named per job (`nd-<job>-<rank>-<pidns>-<pid>`), and each rank unlinks its
own as soon as every local peer reports (through the store) that it has mapped it, so /dev/shm
holds nothing once the group is up, even if a process is killed later (a rank that has every
peer's report unlinks the peers' segments too: an owner killed before its own unlink leaves
nothing while a peer lives on); an atexit hook unlinks a
segment whose peers never came, a SIGTERM from its creation on unlinks it too, and a rank that
sees a peer die during the set-up fails at once naming it and unlinks the peer's segment. What
none of these can reach, a segment whose creator and every peer were SIGKILLed during the set-up,
the next set-up on the host unlinks (`sweep_orphans`: its name says its creator is gone).
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import errno
import logging
import mmap
import os
import re
import signal
import stat
import struct
import threading
import time
import warnings
from collections import deque

import torch

from ..config import env_flag, env_int
from . import cma, frame
from .bytecopy import copy_into
from .base import AT_EXIT, Transport, TransportContext, TransportError, descriptor_advice, process_dead

log = logging.getLogger("neuron_dist.transport")
warnings.filterwarnings("ignore", message="The given buffer is not writable")

SHM_DIR = "/dev/shm"
LINE = 64
SLOT_HEADER = 64
DEFAULT_SLOTS = 4
# NEURON_DIST_SHM_SLOTS' ceiling: far beyond any use (a ring's point is a few slots), and low
# enough that a segment's size stays a number mmap takes (10**17 slots: a bare OverflowError)
MAX_SLOTS = 1 << 16
# cap of one futex sleep: a safety net (`ring`'s fence loses no wake-up), no shorter than a
# stalled engine's longest wait (group.STALL_WAIT_MAX_S): at 50 ms against the engine's 0.1 s, a
# rank waiting long for a late peer woke twice per engine wait to find nothing
MAX_SLEEP = 0.25
# a gone peer's grace (`gone_grace`): only long enough for the engine to look at the rings once
# more after it saw the peer gone (a peer SIGKILLed in a collective failed it 0.56-0.70 s later
# with the 0.5 s grace that frames in flight over a socket need; Gloo fails it in ~0.03 s)
GONE_GRACE_S = 0.005
YIELD_US = 1000  # default yielding spin after the first (NEURON_DIST_SHM_YIELD_US), a core per rank
_CUTS = 8          # payload views kept per slot (one per frame size and dtype seen; slicing costs ~1 us)
LEND_FRAME_BYTES = 64 << 20  # the largest lent frame: few frames per step, one kernel copy each
LEND_STEP_OVERSUBSCRIBED = 2 << 20  # the smallest step lent where local ranks outnumber cores
# the smallest lent step that its receiver reduces (read in parts, executor): a 2 MiB block won
# as often as it lost against copying through the ring, 8 MiB and larger won (ring.reduce_scatter;
# the torus' reduce-scatter rounds carry the same marks)
LEND_REDUCE_STEP = 4 << 20
_SLOT_HEADER = struct.Struct(frame.HEADER.format + "Q")  # the frame header, then a lent frame's address
assert _SLOT_HEADER.size == SLOT_HEADER
_pack_into = _SLOT_HEADER.pack_into
_LENT_AT = frame.HEADER_SIZE
_unpack_lent = struct.Struct("<Q").unpack_from
_U8 = torch.uint8
_CODE_DTYPE = frame.CODE_DTYPE  # a received slot is handed out viewed as its frame's dtype

# control block offsets
_DOORBELL, _SLEEPING, _CLOSED, _PID, _FAILED, _BASE = 0, 4, 8, 16, 24, 32
_CLOSED_AT_EXIT = 2  # the "closed" word's value for a close made as the process exits (1: any other)

_libc = ctypes.CDLL(None, use_errno=True)
_FENCE_LOCK = threading.Lock()


def _fence() -> None:
    """A full memory fence: taking and giving back an uncontended lock is a locked instruction
    each on x86 (glibc's semaphores: lock cmpxchg, lock xadd), ~60 ns. Each place that writes
    its own word and then reads a peer's to decide whether to wake it (`_Segment.ring`,
    `ShmTransport.release`) needs one: x86 may satisfy the read before the write is seen, and
    the peer, doing the mirror image, then sleeps through the news."""
    _FENCE_LOCK.acquire()
    _FENCE_LOCK.release()


_MACHINE = os.uname().machine
_SYS_FUTEX = 202  # x86-64's (the only machine `available` accepts)
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1


class _timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def available() -> str | None:
    """None if this host can run the transport, else why not. Only x86-64: the rings publish a
    frame with plain stores (payload, then head) and read it with plain loads, correct only
    under x86's store order; on a weaker one (aarch64) a reader could see a head before its
    payload. Such a host falls back to the network transport (`select.plan`)."""
    if _MACHINE != "x86_64":
        return (f"the shared-memory rings rely on x86-64's memory order (no barriers between a frame's "
                f"payload and its ring head), and this machine is {_MACHINE}")
    if not os.path.isdir(SHM_DIR) or not os.access(SHM_DIR, os.W_OK):
        return f"{SHM_DIR} is not a writable directory"
    return None


def _futex_wait(addr: int, expected: int, timeout: float) -> None:
    ts = _timespec(int(timeout), int((timeout % 1) * 1e9))
    _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAIT, ctypes.c_int(expected),
                  ctypes.byref(ts), None, 0)


def _futex_wake(addr: int) -> None:
    _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAKE, ctypes.c_int(1 << 30), None, None, 0)


_OWNED: set[str] = set()  # segments this process created and has not unlinked yet


@atexit.register
def _unlink_leftovers() -> None:
    for path in list(_OWNED):
        try:
            os.unlink(path)
        except OSError:
            pass
    _OWNED.clear()


os.register_at_fork(after_in_child=_OWNED.clear)  # a forked child owns none of its parent's segments


@contextlib.contextmanager
def _unlink_on_sigterm():
    """While a new segment waits for its peers to map it, a SIGTERM (what torch's agent sends
    every rank when one fails, often while the others still set up) would end the process
    without atexit hooks and leave the segment in /dev/shm. In the main thread, with SIGTERM at
    its default, a handler unlinks this process's segments and then dies of SIGTERM as before."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def on_term(signum, frame):
        _unlink_leftovers()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGTERM) is on_term:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _wait_for(store, key: str, timeout: float, gone=None) -> None:
    """Wait for `key` by polling (store.check, then a short sleep growing to 10 ms): a Python
    signal handler (above) runs only between calls, never inside one long blocking store.wait,
    and a TCPStore's sliced waits would each print a time-out warning from C++. `gone()`, if
    given, says why the key can never come (its writer died), ending the wait at once."""
    deadline = time.monotonic() + timeout
    pause = 0.001
    while not store.check([key]):
        why = gone() if gone is not None else None
        if why:
            raise TransportError(why)
        if time.monotonic() > deadline:
            raise TransportError(f"the store key {key!r} did not appear within {timeout:.0f}s: "
                                 f"a local peer never set up its shared memory")
        time.sleep(pause)
        pause = min(pause * 2, 0.01)


def _pid_namespace() -> str:
    """This process's PID namespace (its inode number), which a segment's name carries beside its
    creator's pid: a pid names a process only within its namespace, and containers with PID
    namespaces of their own may share one /dev/shm. "0" where /proc does not say, or where it is
    another namespace's (`unshare -pf` without a /proc of its own: its pids are not this
    process's, so no creator's death can be judged there); then `sweep_orphans` judges no
    segment."""
    try:
        if int(os.readlink("/proc/self")) != os.getpid():
            return "0"
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except (OSError, ValueError):
        return "0"


def _segment_prefix(job_id: str, rank: int) -> str:
    """`rank`'s segment in job `job_id` is this prefix and its pid
    (SHM_DIR/nd-<job>-<rank>-<pidns>-<pid>): the name a rank makes its own, and the only kind
    of path it maps for a peer, so a value planted in the store cannot have a rank map and write
    into another file. Local peers share the PID namespace (`hosts.machine_key`)."""
    return os.path.join(SHM_DIR, f"nd-{job_id}-{rank}-{_pid_namespace()}-")


def sweep_orphans() -> list[str]:
    """Unlink the segments in SHM_DIR whose creator, named by their name, is gone, and return
    their names. A creator unlinks its own segment once its peers have mapped it, or as it
    fails, exits or gets SIGTERM, and a peer unlinks one whose creator died during the set-up;
    only a set-up whose every process was SIGKILLed (a launcher's or scheduler's hard kill of a
    job stuck waiting for a rank that never came) leaves one, and only a later set-up on the
    host can find it. Judged here: this user's regular files named as this package names
    segments, with this PID namespace and a pid that no live process of it holds (a reused pid
    keeps its file until that process ends too); a segment whose creator is gone can never be
    mapped again (its peers fail naming the creator)."""
    ns = _pid_namespace()
    if ns == "0":
        return []
    name = re.compile(rf"nd-[^/]+-[0-9]+-{ns}-([0-9]+)", re.ASCII)
    try:
        entries = os.listdir(SHM_DIR)
    except OSError:
        return []
    swept = []
    for entry in entries:
        m = name.fullmatch(entry)
        if m is None or int(m[1]) == os.getpid() or not process_dead(int(m[1])):
            continue
        path = os.path.join(SHM_DIR, entry)
        try:
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
                os.unlink(path)
                swept.append(entry)
        except OSError:  # gone meanwhile (another rank swept it), or not ours to remove
            pass
    if swept:
        log.debug("unlinked %d shared-memory segment(s) left by processes killed during a set-up: %s",
                  len(swept), ", ".join(swept))
    return swept


def unlink_gone_peer(job_id: str, rank: int, pid: int) -> None:
    """Unlink the segment that `rank` of job `job_id` made as process `pid`, which a peer saw die
    during the set-up (a name this job gives, so nothing else): what it made before it died."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(_segment_prefix(job_id, rank) + str(pid))


class _Segment:
    """One mapped segment: control words and ring/slot addressing."""

    def __init__(self, path: str, nbytes: int, create: bool, npeers: int, nslots: int, slot_bytes: int):
        self.path, self.nslots, self.slot_bytes = path, nslots, slot_bytes
        if create:
            _OWNED.add(path)  # before it exists: a SIGTERM handled right after the open unlinks it
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            except OSError:
                _OWNED.discard(path)
                raise
            try:
                # reserve the pages now: a full /dev/shm (Docker's default is 64 MiB) is then a
                # clean ENOSPC here instead of a SIGBUS at the first write to an unbacked page
                os.posix_fallocate(fd, 0, nbytes)
                self.mm = mmap.mmap(fd, nbytes)
            except OSError:
                os.close(fd)
                fd = -1
                _OWNED.discard(path)
                os.unlink(path)
                raise
            finally:
                if fd >= 0:
                    os.close(fd)
        else:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)  # (a link is refused: ELOOP)
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
                    raise TransportError(f"it is not a segment this job made (a regular file of this user, "
                                         f"mode 0600): mode {stat.filemode(st.st_mode)}, uid {st.st_uid}")
                if st.st_size != nbytes:
                    raise TransportError(f"it has {st.st_size} bytes where this rank expects {nbytes}: "
                                         f"the ranks disagree on NEURON_DIST_SHM_SLOTS or NEURON_DIST_FRAME_BYTES "
                                         f"(or run different versions of neuron_dist)")
                self.mm = mmap.mmap(fd, nbytes)
            finally:
                os.close(fd)
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self.mm))
        self.doorbell = ctypes.c_int32.from_buffer(self.mm, _DOORBELL)
        self.sleeping = ctypes.c_int32.from_buffer(self.mm, _SLEEPING)
        self.closed = ctypes.c_int32.from_buffer(self.mm, _CLOSED)
        self.pid = ctypes.c_int64.from_buffer(self.mm, _PID)
        self.failed = ctypes.c_int32.from_buffer(self.mm, _FAILED)
        self.owner_base = ctypes.c_int64.from_buffer(self.mm, _BASE)  # the segment's address in its owner
        self.bytes = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.rings = []
        for i in range(npeers):
            off = ring_offset(i, nslots, slot_bytes)
            head = ctypes.c_int64.from_buffer(self.mm, off)
            tail = ctypes.c_int64.from_buffer(self.mm, off + LINE)
            slots = []
            for s in range(nslots):
                so = off + 2 * LINE + s * (SLOT_HEADER + slot_bytes)
                # (header offset, payload view, {nbytes: payload[:nbytes]}: cut once per size)
                slots.append((so, self.bytes[so + SLOT_HEADER:so + SLOT_HEADER + slot_bytes], {}))
            self.rings.append((head, tail, slots))

    def ring(self) -> None:
        """Bump the doorbell; wake the owner if it sleeps.

        The fence between the bump and the flag's read closes the store-buffering race with a
        waiter that sets its flag and then reads the doorbell (the futex call fences that side):
        without it both reads could see the old values, the waiter sleeping through the news
        while this ring skipped its wake."""
        self.doorbell.value = (self.doorbell.value + 1) & 0x7FFFFFFF
        _fence()
        if self.sleeping.value:
            _futex_wake(self.base + _DOORBELL)

    def close(self) -> None:
        self.rings, self.bytes = [], None
        self.doorbell = self.sleeping = self.closed = self.pid = self.failed = self.owner_base = None
        try:
            self.mm.close()
        except BufferError:  # a payload view is still alive somewhere; the GC unmaps it later
            pass


def _cut(cuts: dict, body: torch.Tensor, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
    """The first `nbytes` of a slot's payload viewed as `dtype`, kept in the slot's `cuts`
    (up to _CUTS of them) so the next frame of that size and dtype reuses it."""
    view = body[:nbytes] if dtype is _U8 else body[:nbytes].view(dtype)
    if len(cuts) < _CUTS:
        cuts[(nbytes, dtype)] = view
    return view


def _lend_step(record: str) -> int | None:
    """The step size a rank's "mapped" record asks lending to start at; None: it cannot lend."""
    if record.startswith("lend "):
        try:
            return max(0, int(record[5:]))
        except ValueError:
            return None
    return None


def ring_index(owner: int, sender: int) -> int:
    """Which ring of the owner's segment carries the sender's frames (both given as their index
    among the transport's members, sorted by rank): the sender's place among the owner's peers.
    A segment holds no ring for its owner."""
    return sender - (sender > owner)


def ring_offset(i: int, nslots: int, slot_bytes: int) -> int:
    return LINE + i * (2 * LINE + nslots * (SLOT_HEADER + slot_bytes))


def segment_bytes(npeers: int, nslots: int, slot_bytes: int) -> int:
    return ring_offset(npeers, nslots, slot_bytes)


def settings(oversubscribed: bool = False) -> tuple[int, float, float, bool]:
    """This transport's settings from the environment: ring slots, spin and yield-spin before a
    wait sleeps (seconds; their defaults depend on whether local ranks outnumber cores: then
    yield instead of spinning, the peer may need this core; with a core per rank, spin on with
    sched_yield before sleeping, see `wait`), and whether single-copy lending is allowed (on
    unless set off). A group reads them before it meets its peers, so a bad value reaches them."""
    return (env_int("NEURON_DIST_SHM_SLOTS", DEFAULT_SLOTS, minimum=2, maximum=MAX_SLOTS),
            env_int("NEURON_DIST_SHM_SPIN_US", 20 if oversubscribed else 50, minimum=0) * 1e-6,
            env_int("NEURON_DIST_SHM_YIELD_US", 0 if oversubscribed else YIELD_US, minimum=0) * 1e-6,
            env_flag("NEURON_DIST_SHM_LEND", default=True))


class ShmTransport(Transport):
    name = "shm"

    def __init__(self, ctx: TransportContext, peers: list[int] | None = None, key: str = "shm"):
        why = available()
        if why:
            raise TransportError(f"rank {ctx.rank}: shared memory unavailable: {why}")
        self.rank, self.token = ctx.rank, ctx.token
        self.peers = [p for p in (peers if peers is not None else range(ctx.size)) if p != ctx.rank]
        for p in self.peers:
            if ctx.hosts and ctx.hosts[p] != ctx.hostname:
                raise TransportError(f"rank {self.rank} cannot reach rank {p} over shared memory: "
                                     f"rank {p} runs on {ctx.hosts[p]}, this rank on {ctx.hostname}")
        # whole cache lines: every slot's payload starts aligned for any dtype's view
        self.slot_bytes = -(-frame.frame_bytes_setting() // LINE) * LINE
        # the cores the local ranks share (ranks bound one per core see one core each)
        ncpu = ctx.local_cpus or len(os.sched_getaffinity(0))
        self.oversubscribed = len(self.peers) + 1 > ncpu  # more local ranks than cores
        self.nslots, self.spin, self.yield_spin, self.lend_allowed = settings(self.oversubscribed)
        self._spun = 0.0  # seconds this rank has spun since something last moved (see `wait`)
        self.closed = False
        self._woken = False  # set by wake() (another thread of this rank): the next wait returns
        self._seen: dict[int, int] = {}  # what the last wait saw: peer -> ring head, ~peer -> tail (`_news`)
        # the members of this transport, in one order every rank agrees on
        members = sorted(self.peers + [self.rank])
        self.index = {r: i for i, r in enumerate(members)}
        npeers = len(self.peers)  # one inbound ring per peer (see ring_index)
        nbytes = segment_bytes(npeers, self.nslots, self.slot_bytes)
        sweep_orphans()
        path = _segment_prefix(ctx.job_id, self.rank) + str(os.getpid())
        wait = ctx.timeout.total_seconds() if ctx.timeout else 1800.0
        self.theirs: dict[int, _Segment] = {}
        # from the segment's creation until the peers have mapped it, only a name holds it: a
        # SIGTERM in that time (torch's agent sends every rank one when another fails at
        # start-up), even inside a slow posix_fallocate of a large one, unlinks it
        with _unlink_on_sigterm():
            records = self._set_up(ctx, key, path, nbytes, npeers, wait)
        records[self.rank] = self._probe_result
        steps = {r: _lend_step(v) for r, v in records.items()}
        no = [(r, records[r]) for r, b in sorted(steps.items()) if b is None]
        # the same answers on every rank, from the same records: whether to lend, and from
        # which step size (the largest any rank asked for)
        self.lend_bytes = LEND_FRAME_BYTES if self.peers and not no else 0
        self.lend_from = max((b for b in steps.values() if b), default=0)
        self.lend_min = self.slot_bytes // 2  # a lent step's shorter tail frame is copied through a slot
        # a step its receiver reduces (ring and torus reduce-scatter) is lent only from larger blocks
        self.lend_reduce_from = max(self.lend_from, LEND_REDUCE_STEP)
        self.eager_bytes = self.nslots * self.slot_bytes  # a send this large fills the ring: it waits anyway
        self.lent: dict[int, deque] = {}      # peer -> (head after the frame, tensor) lent, not yet released
        self.held_lent: set[int] = set()      # peers whose frame now held here is lent
        self.lent_frames = 0                  # frames lent so far (tests and debugging)
        if self.peers:
            log.debug("rank %d: single-copy lending %s", self.rank, "on" if not no else
                      "off: " + "; ".join(f"rank {r}: {v}" for r, v in no))
        self.peer_pid = {p: self.theirs[p].pid.value for p in self.peers}
        # sender side: my ring inside each peer's segment; receiver side: peers' rings in mine
        ix = self.index
        self.out = {p: self.theirs[p].rings[ring_index(ix[p], ix[self.rank])] for p in self.peers}
        self.inn = {p: self.mine.rings[ring_index(ix[self.rank], ix[p])] for p in self.peers}
        self.head = {p: 0 for p in self.peers}   # my sends to p (I am the only writer)
        self.tail = {p: 0 for p in self.peers}   # my receives from p (I am the only writer)
        self.held: set[int] = set()              # peers whose last frame is still lent out
        self.blocked: set[int] = set()           # peers whose ring was full at the last send
        self.doorbell_addr = self.mine.base + _DOORBELL
        log.debug("rank %d: shm rings with ranks %s: %d slots x %d KiB per pair (%d KiB mapped); spin %d us, "
                  "then %d us yielding%s",
                  self.rank, self.peers, self.nslots, self.slot_bytes >> 10, nbytes * (1 + len(self.peers)) >> 10,
                  round(self.spin * 1e6), round(self.yield_spin * 1e6),
                  f" with sched_yield ({len(self.peers) + 1} local ranks on {ncpu} cores)"
                  if self.oversubscribed else "")

    def _set_up(self, ctx: TransportContext, key: str, path: str, nbytes: int, npeers: int,
                wait: float) -> dict[int, str]:
        """Make this rank's segment, publish it, map every peer's, and exchange the "mapped"
        records (returned, per peer); this rank's segment is unlinked on the way out, done or
        failed."""
        try:
            self.mine = _Segment(path, nbytes, True, npeers, self.nslots, self.slot_bytes)
        except OSError as e:
            if e.errno in (errno.EMFILE, errno.ENFILE):  # not the space: the descriptors ran out
                why = f"rank {self.rank} cannot open its shared-memory segment: {e}; {descriptor_advice()}"
            else:
                why = (f"rank {self.rank} cannot allocate its {nbytes >> 10} KiB shared-memory segment in "
                       f"{SHM_DIR}: {e}. Enlarge {SHM_DIR} (docker run --shm-size), lower NEURON_DIST_SHM_SLOTS "
                       f"or NEURON_DIST_FRAME_BYTES, or set NEURON_DIST_TRANSPORT=zmq")
            self.publish_error(ctx.store, key, self.rank, why)  # peers fail at once, not at a time-out
            raise TransportError(why) from None
        try:
            self.mine.pid.value = os.getpid()
            self.mine.owner_base.value = self.mine.base
            ctx.store.set(f"{key}/{self.rank}", path)
            for p in self.peers:
                _wait_for(ctx.store, f"{key}/{p}", wait, lambda p=p: self._died_unpublished(ctx, p))
                where = ctx.store.get(f"{key}/{p}").decode()
                failed = self.setup_error(where)
                if failed:
                    raise TransportError(self._no_shm(p, failed))
                theirs = _segment_prefix(ctx.job_id, p)  # the store is read, not trusted
                if not re.fullmatch(re.escape(theirs) + r"[0-9]+", where, re.ASCII):
                    raise TransportError(f"rank {self.rank}: rank {p} published {where!r} as its shared-memory "
                                         f"segment, not a name this job gives one ({theirs}<pid>)")
                try:
                    self.theirs[p] = _Segment(where, nbytes, False, npeers, self.nslots, self.slot_bytes)
                except (OSError, TransportError) as e:
                    why = self._unmappable(ctx.store, key, p, e, int(where[len(theirs):]))
                    ctx.store.set(f"{key}/{self.rank}/mapped", "error: " + why)  # peers fail at once
                    raise TransportError(why) from None
            # "lend <step bytes>" once this rank can read every peer's memory (cma.probe),
            # else why not
            self._probe_result = self._probe_lending()
            ctx.store.set(f"{key}/{self.rank}/mapped", self._probe_result)
            for p in self.peers:
                _wait_for(ctx.store, f"{key}/{p}/mapped", wait, lambda p=p: self._died_in_setup(p))
            records = {p: ctx.store.get(f"{key}/{p}/mapped").decode() for p in self.peers}
            for p, record in records.items():
                failed = self.setup_error(record)
                if failed:
                    raise TransportError(self._no_shm(p, failed))
            # every local rank has mapped every segment now: the peers' go too, not only at each
            # owner's own unlink, which a peer killed before it got there (while this rank, with
            # its record in hand, went on) never made, leaving its segment to the next set-up
            for seg in self.theirs.values():
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(seg.path)
        finally:
            self._unlink()
        return records

    def _died_unpublished(self, ctx: TransportContext, p: int) -> str | None:
        """Why peer `p`, whose segment this rank waits to read in the store, can never publish
        it: its process (the pid it met with) is gone, else None. A segment it made before it
        died (its name this job's for rank p with that pid) goes too: nobody else would unlink
        it before the host's next set-up, and its peers waited out the time-out for the name."""
        pid = ctx.pids[p] if p < len(ctx.pids) else 0
        if pid <= 0 or not process_dead(pid):
            return None
        unlink_gone_peer(ctx.job_id, p, pid)
        return self._exited_in_setup(p, pid) + ", before it published its segment"

    def _died_in_setup(self, p: int) -> str | None:
        """Why peer `p`, whose segment this rank mapped, can never finish the set-up: its process
        is gone (a SIGKILL, the OOM killer), else None. Its segment, which it never got to
        unlink, goes too: a name this job gives, checked and mapped here, so nothing else."""
        seg = self.theirs[p]
        pid = seg.pid.value
        if not process_dead(pid):
            return None
        try:
            os.unlink(seg.path)
        except FileNotFoundError:
            pass
        return self._exited_in_setup(p, pid) + ", before it had mapped every local peer's segment"

    def _exited_in_setup(self, p: int, pid: int) -> str:
        return f"rank {self.rank}: rank {p} (pid {pid}) exited during the shared-memory set-up"

    def _probe_lending(self) -> str:
        """"lend <bytes>" if lending is allowed here and this rank can read each peer's memory
        (the step size from which this rank would lend), else why not."""
        if not self.lend_allowed:
            why = "NEURON_DIST_SHM_LEND=0"
        else:
            why = None
            for p in self.peers:
                seg = self.theirs[p]
                why = cma.probe(seg.pid.value, seg.owner_base.value + _PID, seg.pid.value.to_bytes(8, "little"))
                if why:
                    why = f"cannot read rank {p}'s memory: {why}"
                    break
        if why:
            return why
        # ranks that outnumber the cores: a lent step makes the sender wait for readers that
        # share its core, which lost 2-3x at 256 KiB-1 MiB blocks here (all-to-all, broadcast at
        # world 4 on 2 cores) and won from 2-4 MiB; with a core each, lending starts at half a slot
        # (256 KiB by default)
        step = LEND_STEP_OVERSUBSCRIBED if self.oversubscribed else self.slot_bytes // 2
        return f"lend {step}"

    def _unmappable(self, store, key: str, p: int, e: BaseException, pid: int) -> str:
        """Why this rank cannot map peer p's segment (made by process `pid`), for every rank to
        read. A segment that is gone was unlinked by its owner on the way out of a failed
        set-up, after publishing why (in its "mapped" record), or, once its owner was killed,
        by a peer or another set-up's sweep (`sweep_orphans`): then the owner's death is the
        cause, as `_died_in_setup` words it."""
        if isinstance(e, FileNotFoundError):
            record = store.get(f"{key}/{p}/mapped").decode() if store.check([f"{key}/{p}/mapped"]) else ""
            cause = self.setup_error(record)
            if not cause and process_dead(pid):
                return self._exited_in_setup(p, pid)
            return self._no_shm(p, cause or f"rank {p}'s segment is gone: its process ended or failed its "
                                            f"set-up without saying why")
        return f"rank {self.rank}: cannot map rank {p}'s shared-memory segment: {e}"

    def _no_shm(self, p: int, cause: str) -> str:
        return f"rank {self.rank}: no shared memory with rank {p}: {cause}"

    def _unlink(self) -> None:
        path = self.mine.path
        if path in _OWNED:
            _OWNED.discard(path)
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    # -- data path ---------------------------------------------------------------------------
    def send(self, peer, header, payload):
        head, tail, slots = self.out[peer]
        n = payload.nbytes
        if n > self.slot_bytes:
            raise TransportError(f"rank {self.rank}: a {n}-byte frame for rank {peer} exceeds the "
                                 f"{self.slot_bytes}-byte shared-memory slot (NEURON_DIST_FRAME_BYTES)")
        h = self.head[peer]
        if h - tail.value >= self.nslots:
            self.blocked.add(peer)
            return False
        off, body, cuts = slots[h % self.nslots]
        seg = self.theirs[peer]
        _pack_into(seg.mm, off, frame.MAGIC, frame.VERSION, *header, 0)
        if n:
            dt = payload.dtype
            dst = cuts.get((n, dt))
            if dst is None:  # the slot viewed as the payload's dtype: the copy then moves raw bytes
                dst = _cut(cuts, body, n, dt)
            copy_into(dst, payload)
        self.blocked.discard(peer)
        head.value = h + 1
        self.head[peer] = h + 1
        seg.ring()
        return True

    def lend(self, peer, header, payload):
        """Like `send`, but the slot carries the address of `payload` (contiguous, any size up to
        `lend_bytes`), which the peer reads itself. Returns a ticket (0: the ring is full, try
        later): the caller keeps `payload` unchanged until `released(peer, ticket)` (a reference
        is kept here until then). Each op watches its own tickets: a transport-wide "anything
        still lent" would have a collective wait for a large isend to a peer that posts its
        receive only after that collective."""
        head, tail, slots = self.out[peer]
        h = self.head[peer]
        if h - tail.value >= self.nslots:
            self.blocked.add(peer)
            return 0
        off = slots[h % self.nslots][0]
        seg = self.theirs[peer]
        _pack_into(seg.mm, off, frame.MAGIC, frame.VERSION, *header, payload.data_ptr())
        q = self.lent.get(peer)
        if q is None:
            q = self.lent[peer] = deque()
        q.append((h + 1, payload))
        self.lent_frames += 1
        self.blocked.discard(peer)
        head.value = h + 1
        self.head[peer] = h + 1
        seg.ring()
        return h + 1

    def released(self, peer, ticket) -> bool:
        """Whether `peer` has released the frame `lend` gave `ticket` (and so every one before)."""
        done = self.out[peer][1].value
        q = self.lent.get(peer)
        while q and q[0][0] <= done:
            q.popleft()  # drop the references to what was read
        return done >= ticket

    def still_lent(self):
        """The first peer that has yet to release a frame this rank lent it, or None."""
        for p in list(self.lent):
            q = self.lent[p]
            if q and not self.released(p, q[-1][0]):
                return p
            del self.lent[p]
        return None

    def recv(self, peer):
        head, tail, slots = self.inn[peer]
        t = self.tail[peer]
        if head.value == t:
            return None
        off, body, cuts = slots[t % self.nslots]
        h = frame.unpack_from(self.mine.mm, off)
        if h.token != self.token:
            raise frame.FrameError(f"rank {self.rank}: a frame in the ring from rank {peer} carries a wrong job token")
        if h.src != peer or h.dst != self.rank:
            raise frame.FrameError(f"rank {self.rank}: frame in the ring from rank {peer} claims to come from "
                                   f"rank {h.src} to rank {h.dst}")
        dt = _CODE_DTYPE.get(h.dtype, _U8)
        if self.lend_bytes:
            addr = _unpack_lent(self.mine.mm, off + _LENT_AT)[0]
            if addr:
                if h.nbytes > self.lend_bytes:
                    raise frame.FrameError(f"rank {self.rank}: lent frame from rank {peer} claims {h.nbytes} bytes, "
                                           f"more than a lent frame may hold ({self.lend_bytes})")
                self.held.add(peer)
                self.held_lent.add(peer)
                return h, cma.Lent(self.peer_pid[peer], addr, h.nbytes, dt, peer, self.theirs[peer].failed)
        if h.nbytes > self.slot_bytes:
            raise frame.FrameError(f"rank {self.rank}: frame from rank {peer} claims {h.nbytes} bytes, "
                                   f"more than a slot holds")
        self.held.add(peer)
        view = cuts.get((h.nbytes, dt))
        if view is None:  # typed as the header says (frame.unpack checked nbytes is whole elements)
            view = _cut(cuts, body, h.nbytes, dt)
        return h, view

    def release(self, peer):
        if peer not in self.held:
            return
        self.held.discard(peer)
        t = self.tail[peer] + 1
        self.tail[peer] = t
        head, tail, _ = self.inn[peer]
        tail.value = t
        # only a sender that found the ring full waits for a free slot, or one that lent the
        # frame: wake the peer only then (a wake-up for a peer that waits on data is spurious
        # and, on a busy host, costly)
        if peer in self.held_lent:
            self.held_lent.discard(peer)
            self.theirs[peer].ring()
        else:
            _fence()  # the freed slot seen before the head is read (see `_fence`)
            if head.value - (t - 1) >= self.nslots:
                self.theirs[peer].ring()

    def _news(self) -> bool:
        """Whether something arrived or was freed since the last look: a frame in a ring, a slot
        freed for a blocked send, a lent frame released. A frame that was already waiting at the
        last look is not news: the caller's progress pass since then saw it and could not take
        it yet (it belongs to a peer's next collective, or to a receive not yet posted). Counted
        as news, it kept every wait from sleeping, and the engine spun a whole core until the op
        it really waited on moved."""
        seen, news = self._seen, False
        for p in self.peers:
            h = self.inn[p][0].value
            if h != self.tail[p] and h != seen.get(p):
                news = True
            seen[p] = h
        for p in self.blocked:  # its ring was full: any slot freed since is news
            t = self.out[p][1].value
            if t != seen.get(~p):
                news = True
            seen[~p] = t
        for p, q in self.lent.items():
            if q:
                t = self.out[p][1].value
                if t != seen.get(~p) and t >= q[0][0]:
                    news = True
                seen[~p] = t
        return news

    def wake(self):
        """Set the flag a wait looks at, then ring this rank's own doorbell (a waiter asleep on
        the futex wakes; the flag covers a waiter that has yet to sleep, and a ring a peer's
        concurrent ring overwrote)."""
        self._woken = True
        try:
            self.mine.ring()
        except (AttributeError, ValueError, TypeError):  # closed meanwhile: nobody waits any more
            pass

    def wait(self, timeout):
        """Until something may have moved (a frame, a freed slot, a release, `wake`) or `timeout`.

        Three phases per episode of waiting (from the last time something moved, over however
        many calls the caller makes): a spin on the doorbell (`spin`), a spin that yields the
        core at each turn (`yield_spin`), then futex sleeps. A futex wake-up costs a sleeper
        100-250 us on the VMs measured, so a peer a millisecond late costs a sleeping rank more
        than its lateness; yielding keeps the core for any thread that needs it (a peer's thread
        the kernel woke on this CPU, this rank's own compute). The budget is per episode, so a
        rank that waits long (a barrier while a peer checkpoints) spins once, then sleeps."""
        if self._woken:
            self._woken = False
            self._spun = 0.0
            return
        bell = self.mine.doorbell
        v = bell.value
        if self._news():
            self._spun = 0.0
            return
        now = time.perf_counter()
        deadline = now + timeout
        budget = self.spin + self.yield_spin - self._spun
        if budget > 0:
            start = now
            end = now + min(budget, timeout)
            # a core per rank: spin without sched_yield at first (under load it hands the core
            # away for a whole time slice); oversubscribed, `spin` yields from the start
            hot_end = now if self.oversubscribed else now + max(0.0, self.spin - self._spun)
            while now < end:
                if bell.value != v or self._woken:  # (a wake this return answers, as any return
                    self._spun, self._woken = 0.0, False  # does: the caller's next pass sees it)
                    return
                if now >= hot_end:
                    os.sched_yield()
                now = time.perf_counter()
            self._spun += now - start
        sleeping = self.mine.sleeping
        while True:
            left = deadline - time.perf_counter()
            if left <= 0:
                return
            sleeping.value = 1
            if bell.value == v and not self._woken and not self._news():
                _futex_wait(self.doorbell_addr, v, min(left, MAX_SLEEP))
                news = bell.value != v or self._woken or self._news()
            else:
                news = True
            sleeping.value = 0
            if news:
                self._spun, self._woken = 0.0, False
                return

    def flush(self, timeout):
        """Until every lent frame is released (or `timeout`): copied sends never refer to
        caller memory."""
        deadline = time.monotonic() + timeout
        while self.still_lent() is not None and time.monotonic() < deadline:
            self.wait(min(0.001, max(0.0, deadline - time.monotonic())))

    def mark_failed(self):
        """Set this rank's "failed" word and ring every peer: an ABORT frame does not fit a ring
        the peer has not drained (a late peer), and only a peer that reads it learns the cause."""
        if self.closed or self.mine.failed is None:
            return
        self.mine.failed.value = 1
        for seg in self.theirs.values():
            seg.ring()

    def check_peer(self, peer):
        seg = self.theirs.get(peer)
        if seg is None or seg.closed is None:
            return None
        failed = self.peer_failed(peer)
        if failed:
            return failed
        if seg.closed.value:
            return f"rank {peer} closed its shared-memory transport" + (
                AT_EXIT if seg.closed.value == _CLOSED_AT_EXIT else "")
        if process_dead(self.peer_pid[peer]):
            return f"rank {peer} (pid {self.peer_pid[peer]}) exited"
        return None

    def peer_failed(self, peer):
        seg = self.theirs.get(peer)
        if seg is not None and seg.failed is not None and seg.failed.value:
            return f"rank {peer}'s copy of the group failed or was aborted (rank {peer}'s own error says why)"
        return None

    def gone_grace(self, peer):
        """No frame is in flight here: whatever a peer wrote before it ended is in its ring
        already, so the engine's next look at the rings, which the grace lets happen, is the
        last one that can find anything of it."""
        return GONE_GRACE_S

    def peer_finished(self, peer):
        seg = self.theirs.get(peer)  # closed, and not after a failure (an abort closes too)
        return bool(seg is not None and seg.closed is not None and seg.closed.value and not seg.failed.value)

    def peer_exiting(self, peer):
        seg = self.theirs.get(peer)
        return bool(seg is not None and seg.closed is not None and seg.closed.value == _CLOSED_AT_EXIT)

    def close(self, abort: bool = False, exiting: bool = False):
        if self.closed:
            return
        self.closed = True
        self._unlink()
        try:
            # memory this rank lent and a peer has yet to read: the caller may reuse it once
            # this returns (a destroy that gave up on a send), and a peer that reads it later
            # would take that as the frame. The "failed" word makes its read fail instead
            # (`cma.Lent.read_part` checks it after each read), and tells it why.
            if self.still_lent() is not None:
                self.mine.failed.value = 1
            self.mine.closed.value = _CLOSED_AT_EXIT if exiting else 1
            for seg in self.theirs.values():
                seg.ring()
        except (AttributeError, ValueError):
            pass
        self.out, self.inn = {}, {}
        self.lent = {}
        for seg in self.theirs.values():
            seg.close()
        self.mine.close()

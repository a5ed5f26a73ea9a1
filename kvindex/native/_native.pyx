# cython: language_level=3, boundscheck=True, wraparound=False, cdivision=True
# distutils: language = c++
# distutils: extra_compile_args = -O2 -std=c++17
"""The compiled hot path of the index (issue 26): the block-key chain and the in-memory index's
maps. ``kvindex.native`` loads it, or says why not; ``kvindex.keys`` and ``kvindex.memory`` keep
the pure-Python versions the same tests run against.

* ``chain_digests(tokens, block_size, parent, tail)``: ``kvindex.keys.chain_digests`` with the
  extra keys already encoded (``tail``): each block's canonical CBOR built in one buffer and
  hashed with SHA-256 (``sha256.h``), byte for byte what the Python chain hashes.
* ``Core``: the maps of ``kvindex.memory.PyCore`` (``core.hpp``), the same calls and answers.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.exc cimport PyErr_Clear, PyErr_Occurred
from cpython.long cimport PyLong_Check
from cpython.tuple cimport PyTuple_Check, PyTuple_GET_ITEM, PyTuple_GET_SIZE
from cpython.sequence cimport PySequence_Fast, PySequence_Fast_GET_ITEM, PySequence_Fast_GET_SIZE
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memcmp, memcpy
from libcpp cimport bool as cbool
from libcpp.unordered_map cimport unordered_map
from libcpp.utility cimport pair
from libcpp.vector cimport vector

import os


cdef extern from "Python.h":
    # Without Cython's exception check: the callers tell an overflow from the value and clear it.
    unsigned long long PyLong_AsUnsignedLongLong(object) noexcept


cdef extern from *:
    """
    /* A non-negative int below 2**30 read from its one digit (CPython 3.11's layout), or 0. */
    static inline int kv_small_int(PyObject *o, uint64_t *out) {
    #if PY_VERSION_HEX < 0x030C0000
        if (PyLong_CheckExact(o)) {
            Py_ssize_t size = Py_SIZE(o);
            if (size == 0) { *out = 0; return 1; }
            if (size == 1) { *out = ((PyLongObject *)o)->ob_digit[0]; return 1; }
        }
    #endif
        return 0;
    }
    """
    bint kv_small_int(object, uint64_t *) noexcept


cdef extern from "sha256.h":
    void kv_sha256(const uint8_t *data, size_t length, uint8_t *out) nogil
    void kv_sha256_portable(const uint8_t *data, size_t length, uint8_t *out) nogil
    int kv_sha256_use_openssl(const char *soname)


cdef extern from "core.hpp" namespace "kvn":
    void set_hash_seed(uint64_t)
    int64_t KEY_ENTRY_BYTES
    int64_t HOLDER_ENTRY_BYTES
    int64_t ENGINE_ENTRY_BYTES

    cdef struct Digest:
        uint8_t len
        uint8_t d[32]

    cdef cppclass Block:
        uint64_t key
        uint32_t n
        uint64_t *holders()

    cdef cppclass Pod:
        uint32_t tier_ids[64]
        uint64_t tier_keys[64]
        int ntiers
        uint64_t entries

    cdef cppclass Model:
        unordered_map[uint32_t, Pod *] pods

    cdef cppclass Maps "kvn::Core":
        uint64_t max_keys
        uint32_t pod_cache_size
        int64_t max_bytes
        int64_t bytes_
        uint64_t nkeys_
        uint64_t refused_tiers
        Maps(uint64_t, uint32_t, int64_t)
        size_t model_count()
        Model *model(uint32_t)
        Pod *pod(uint32_t, uint32_t)
        Block *block(uint32_t, uint64_t)
        void touch(Block *)
        void store(uint32_t, uint32_t, uint32_t, size_t, const uint64_t *, const uint64_t *,
                   const Digest *) except +
        size_t remove(uint32_t, uint32_t, uint32_t, size_t, const uint64_t *) except +
        size_t clear_pod_slice(uint32_t, uint32_t, uint64_t, cbool *) except +
        void close()
        int64_t recount_bytes()
        size_t allocated_bytes()
        void model_blocks(Model *, vector[uint32_t] &) except +
        Block *block_at(uint32_t)
        void pod_keys(Pod *, vector[uint64_t] &, vector[uint64_t] &) except +
        void pod_links(Pod *, vector[uint64_t] &, vector[uint64_t] &) except +
        void pod_engine(Pod *, vector[uint64_t] &, vector[uint64_t] &) except +
        Digest *engine_digest(Pod *, uint64_t)


set_hash_seed(int.from_bytes(os.urandom(8), "little"))



def _sha256_backend():
    cdef bytes soname
    if os.environ.get("KVCACHE_NATIVE_SHA256", "") != "portable":
        for soname in (b"libcrypto.so.3", b"libcrypto.so"):
            if kv_sha256_use_openssl(soname):
                return "openssl"
    return "portable"


sha256_backend = _sha256_backend()
"""Which SHA-256 the chain uses: ``openssl`` (libcrypto's, the CPU's SHA instructions where it
has them) or ``portable`` (``sha256.h``'s own), which ``KVCACHE_NATIVE_SHA256=portable`` forces."""


def sha256_portable(bytes data):
    """The portable SHA-256 of ``data`` (the tests hold it to hashlib's)."""
    cdef uint8_t out[32]
    kv_sha256_portable(<const uint8_t *>PyBytes_AS_STRING(data), PyBytes_GET_SIZE(data), out)
    return PyBytes_FromStringAndSize(<char *>out, 32)



# -- the block-key chain ---------------------------------------------------------------------


cdef inline size_t _head(uint8_t *out, uint8_t major, uint64_t n) noexcept:
    """Canonical CBOR head of ``major`` with argument ``n`` at ``out``; returns its length."""
    cdef uint8_t mt = major << 5
    cdef int i, width
    if n < 24:
        out[0] = mt | <uint8_t>n
        return 1
    if n < 0x100:
        out[0] = mt | 24
        width = 1
    elif n < 0x10000:
        out[0] = mt | 25
        width = 2
    elif n < 0x100000000:
        out[0] = mt | 26
        width = 4
    else:
        out[0] = mt | 27
        width = 8
    for i in range(width):
        out[width - i] = <uint8_t>(n >> (8 * i))
    return width + 1


cdef inline uint64_t _token(object t) except? 0xFFFFFFFFFFFFFFFF:
    """A token id as uint64: ``TypeError`` for a non-int, ``ValueError`` outside uint64."""
    cdef uint64_t small
    if kv_small_int(t, &small):
        return small
    if not PyLong_Check(t):
        raise TypeError(f"a token id must be an int, not {type(t).__name__}")
    cdef uint64_t value = PyLong_AsUnsignedLongLong(t)
    if value == 0xFFFFFFFFFFFFFFFF and PyErr_Occurred() != NULL:
        PyErr_Clear()
        raise ValueError(f"token id {t} is not an unsigned 64-bit integer")
    return value


def first_invalid_token(tokens):
    """The index of the first item of ``tokens`` that is not an int in 0..2**64-1, else -1."""
    cdef object seq = PySequence_Fast(tokens, "tokens must be a sequence")
    cdef Py_ssize_t i
    cdef uint64_t value
    for i in range(PySequence_Fast_GET_SIZE(seq)):
        if not kv_small_int(<object>PySequence_Fast_GET_ITEM(seq, i), &value) and not _u64(
            <object>PySequence_Fast_GET_ITEM(seq, i), &value
        ):
            return i
    return -1


def chain_keys(tokens, Py_ssize_t block_size, bytes parent, bytes tail):
    """The block keys (last 8 bytes of each digest, big-endian) of ``chain_digests``: no digest
    object made."""
    cdef list out = []
    _chain(tokens, block_size, parent, tail, out, True)
    return out


def chain_digests(tokens, Py_ssize_t block_size, bytes parent, bytes tail):
    """Digests of every full block of ``tokens``, chained from ``parent``, each block's CBOR
    ``[parent, tokens, extra]`` ending with ``tail`` (the extra keys' CBOR): what
    ``kvindex.keys.chain_digests`` returns, and raises, for the same input."""
    cdef list out = []
    _chain(tokens, block_size, parent, tail, out, False)
    return out


cdef int _chain(tokens, Py_ssize_t block_size, bytes parent, bytes tail, list out, bint keys) except -1:
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    cdef object seq = PySequence_Fast(tokens, "tokens must be a sequence of ints")
    cdef Py_ssize_t n = PySequence_Fast_GET_SIZE(seq) // block_size * block_size
    cdef Py_ssize_t parent_len = PyBytes_GET_SIZE(parent), tail_len = PyBytes_GET_SIZE(tail)
    cdef Py_ssize_t blocks = n // block_size, b, i, pos, start
    cdef vector[uint64_t] ids
    ids.resize(n)
    for i in range(n):
        ids[i] = _token(<object>PySequence_Fast_GET_ITEM(seq, i))
    # One buffer: heads (<= 10 bytes), parent, array head (<= 9), tokens (<= 9 each), tail.
    cdef vector[uint8_t] buf
    buf.resize(20 + max(parent_len, 32) + 9 * block_size + tail_len)
    cdef uint8_t *p = buf.data()
    cdef uint8_t digest[32]
    cdef uint64_t key
    cdef int k
    cdef const uint8_t *prev = <const uint8_t *>PyBytes_AS_STRING(parent)
    cdef Py_ssize_t prev_len = parent_len
    for b in range(blocks):
        p[0] = 0x83
        pos = 1 + _head(p + 1, 2, prev_len)
        memcpy(p + pos, prev, prev_len)
        pos += prev_len
        pos += _head(p + pos, 4, block_size)
        start = b * block_size
        for i in range(start, start + block_size):
            pos += _head(p + pos, 0, ids[i])
        memcpy(p + pos, PyBytes_AS_STRING(tail), tail_len)
        pos += tail_len
        kv_sha256(p, pos, digest)
        if keys:
            key = 0
            for k in range(24, 32):
                key = (key << 8) | digest[k]
            out.append(key)
        else:
            out.append(PyBytes_FromStringAndSize(<char *>digest, 32))
        prev = digest
        prev_len = 32
    return 0


# -- the in-memory index's maps ----------------------------------------------------------------


cdef class _Names:
    """Strings interned as small ids (models, pods, tiers): never forgotten, so an id is stable."""

    cdef dict ids
    cdef list names

    def __cinit__(self):
        self.ids = {}
        self.names = []

    cdef uint32_t intern(self, str name) except? 0xFFFFFFFF:
        ident = self.ids.get(name)
        if ident is None:
            if len(self.names) >= 0xFFFFFFFE:
                raise OverflowError("too many distinct names")
            ident = self.ids[name] = len(self.names)
            self.names.append(name)
        return ident

    cdef long find(self, str name):
        ident = self.ids.get(name)
        return -1 if ident is None else ident


cdef inline bint _u64(object value, uint64_t *out):
    """``value`` as uint64 into ``out``; False (no exception) for an int outside uint64."""
    if not PyLong_Check(value):
        return False
    out[0] = PyLong_AsUnsignedLongLong(value)
    if out[0] == 0xFFFFFFFFFFFFFFFF and PyErr_Occurred() != NULL:
        PyErr_Clear()
        return False
    return True


cdef inline bint _same_holders(Block *b, vector[uint64_t] &codes) noexcept:
    return b.n == codes.size() and memcmp(b.holders(), codes.data(), b.n * sizeof(uint64_t)) == 0


cdef class Core:
    """The maps of ``kvindex.memory.PyCore``, in C++: the same calls, the same answers. The
    caller (``MemoryIndex``) holds its lock around every call. ``lookup`` hands consecutive keys
    with the same holders one shared map (never mutate what it returns)."""

    cdef Maps *core
    cdef _Names models, pods, tiers
    cdef list tier_sets  # tier id -> frozenset({tier}), the holder map's usual value

    def __cinit__(self, uint64_t max_keys, uint32_t pod_cache_size, object max_bytes):
        self.core = new Maps(max_keys, pod_cache_size, -1 if max_bytes is None else max_bytes)
        self.models, self.pods, self.tiers = _Names(), _Names(), _Names()
        self.tier_sets = []

    def __dealloc__(self):
        del self.core

    def __len__(self):
        return self.core.nkeys_

    @property
    def bytes(self):
        return self.core.bytes_

    @property
    def refused_tiers(self):
        """Blocks not stored because their pod already held 64 other tiers."""
        return self.core.refused_tiers

    @staticmethod
    def entry_bytes(*, model, pod, tier, digest_size):
        """What one key held by one ``(pod, tier)`` with one engine hash costs: names are
        interned and digests stored in fixed slots, so neither adds to it."""
        return KEY_ENTRY_BYTES + HOLDER_ENTRY_BYTES + ENGINE_ENTRY_BYTES

    def allocated_bytes(self):
        """Bytes the maps have allocated (their tables and the block slab)."""
        return self.core.allocated_bytes()

    cdef object tier_set(self, uint32_t tier):
        while len(self.tier_sets) <= tier:
            self.tier_sets.append(frozenset((self.tiers.names[len(self.tier_sets)],)))
        return self.tier_sets[tier]

    def store(self, str model, str pod, str tier, blocks):
        cdef Py_ssize_t n = len(blocks), i
        cdef vector[uint64_t] keys, hashes
        cdef vector[Digest] digests
        keys.resize(n)
        hashes.resize(n)
        digests.resize(n)
        cdef bytes digest
        cdef Py_ssize_t size
        cdef object seq = PySequence_Fast(blocks, "blocks must be a sequence")
        for i in range(n):
            b = <object>PySequence_Fast_GET_ITEM(seq, i)
            if PyTuple_Check(b) and PyTuple_GET_SIZE(b) == 3:  # a StoredBlock
                key, engine_hash, digest = <object>PyTuple_GET_ITEM(b, 0), <object>PyTuple_GET_ITEM(b, 1), <object>PyTuple_GET_ITEM(b, 2)
            else:
                key, engine_hash, digest = b.key, b.engine_hash, b.digest
            size = PyBytes_GET_SIZE(digest)
            if size > 32:
                raise ValueError(f"a digest is at most 32 bytes, not {size}")
            if not _u64(key, &keys[i]) or not _u64(engine_hash, &hashes[i]):
                raise ValueError(f"block key and engine hash must be uint64: {b!r}")
            digests[i].len = <uint8_t>size
            memcpy(digests[i].d, PyBytes_AS_STRING(digest), size)
        self.core.store(
            self.models.intern(model), self.pods.intern(pod), self.tiers.intern(tier), n,
            keys.data(), hashes.data(), digests.data(),
        )

    def remove(self, str model, str pod, str tier, engine_hashes):
        cdef long m = self.models.find(model), p = self.pods.find(pod), t = self.tiers.find(tier)
        if m < 0 or p < 0 or t < 0:
            return 0
        cdef vector[uint64_t] hashes
        cdef uint64_t h
        for value in engine_hashes:
            if _u64(value, &h):
                hashes.push_back(h)
        return self.core.remove(m, p, t, hashes.size(), hashes.data())

    def clear_pod_slice(self, str model, str pod, uint64_t limit):
        """At most ``limit`` (>= 1) entries of ``pod`` under ``model``: (how many, pod gone)."""
        cdef long m = self.models.find(model), p = self.pods.find(pod)
        if m < 0 or p < 0:
            return 0, True
        cdef cbool done = False
        cdef size_t removed = self.core.clear_pod_slice(m, p, limit, &done)
        return removed, done

    def close(self):
        self.core.close()

    def resolve(self, str model, str pod, engine_hashes):
        cdef long m = self.models.find(model), p = self.pods.find(pod)
        cdef Pod *state = NULL
        if m >= 0 and p >= 0:
            state = self.core.pod(m, p)
        if state == NULL:
            return [None] * len(engine_hashes)
        cdef uint64_t h
        cdef Digest *d
        out = []
        for value in engine_hashes:
            d = NULL
            if _u64(value, &h):
                d = self.core.engine_digest(state, h)
            out.append(None if d == NULL else PyBytes_FromStringAndSize(<char *>d.d, d.len))
        return out

    cdef dict holder_map(self, Block *b, object wanted):
        cdef dict view = {}
        cdef uint64_t *hs = b.holders()
        cdef uint32_t i
        for i in range(b.n):
            pod = self.pods.names[hs[i] >> 32]
            if wanted is not None and pod not in wanted:
                continue
            tiers = view.get(pod)
            tier = self.tier_set(<uint32_t>hs[i])
            view[pod] = tier if tiers is None else tiers | tier
        return view

    def lookup(self, str model, keys, wanted):
        """Holders of the longest held run of ``keys`` (of ``wanted`` pods only, unless None);
        every key returned becomes most recent."""
        cdef long m = self.models.find(model)
        out = []
        if m < 0:
            return out
        cdef uint64_t key
        cdef Block *b
        cdef vector[uint64_t] last  # the holders of the previous key, and their map
        last_view = None
        for value in keys:
            if not _u64(value, &key):
                break
            b = self.core.block(m, key)
            if b == NULL:
                break
            if last_view is not None and _same_holders(b, last):
                view = last_view  # a shared prefix: one map for the run (the scorer sees `is`)
            else:
                view = self.holder_map(b, wanted)
                if not view:
                    break
                last.assign(b.holders(), b.holders() + b.n)
                last_view = view
            self.core.touch(b)
            out.append(view)
        return out

    def holders(self, str model, keys):
        """Holders of every key (``{}`` where none); every key held becomes most recent."""
        cdef long m = self.models.find(model)
        cdef uint64_t key
        cdef Block *b
        out = []
        for value in keys:
            b = NULL
            if m >= 0 and _u64(value, &key):
                b = self.core.block(m, key)
            if b == NULL:
                out.append({})
                continue
            self.core.touch(b)
            out.append(self.holder_map(b, None))
        return out

    def models_held(self):
        """Names of the models some pod holds blocks of."""
        cdef size_t i
        cdef Model *m
        out = []
        for i in range(self.core.model_count()):
            m = self.core.model(i)
            if m != NULL and not m.pods.empty():
                out.append(self.models.names[i])
        return out

    def pods_of(self, str model):
        """Names of the pods holding blocks of ``model``."""
        cdef long i = self.models.find(model)
        cdef Model *m = NULL
        if i >= 0:
            m = self.core.model(i)
        if m == NULL:
            return []
        return [self.pods.names[kv.first] for kv in m.pods]

    def pod_blocks(self, str model):
        """``(pod, {tier: keys})`` of every pod holding blocks of ``model``."""
        cdef long i = self.models.find(model)
        cdef Model *m = NULL
        cdef Pod *p
        cdef int s
        if i >= 0:
            m = self.core.model(i)
        if m == NULL:
            return []
        out = []
        for kv in m.pods:
            p = kv.second
            counts = {}
            for s in range(p.ntiers):
                if p.tier_keys[s]:
                    counts[self.tiers.names[p.tier_ids[s]]] = p.tier_keys[s]
            out.append((self.pods.names[kv.first], counts))
        return out

    def recount_bytes(self):
        """The cost model summed from scratch (tests check ``bytes`` against it)."""
        return self.core.recount_bytes()

    def state(self):
        """Every map as plain Python data, for the invariant checks of the tests: ``blocks``
        ``{(model, key): [(pod, tier), ...] oldest first}``, ``lru`` the ``(model, key)``
        order, and per ``(model, pod)``: ``tiers`` ``{tier: {keys}}``, ``links``
        ``{engine hash: key}`` from the reverse index, ``engine`` ``{engine hash: key of its
        digest}``."""
        cdef size_t i
        cdef uint32_t j, idx
        cdef Model *m
        cdef Pod *p
        cdef Block *b
        cdef vector[uint32_t] idxs
        cdef vector[uint64_t] a, c
        cdef int s
        blocks, pods = {}, {}
        for i in range(self.core.model_count()):
            m = self.core.model(i)
            if m == NULL:
                continue
            model = self.models.names[i]
            self.core.model_blocks(m, idxs)
            for idx in idxs:
                b = self.core.block_at(idx)
                blocks[(model, b.key)] = [
                    (self.pods.names[b.holders()[j] >> 32], self.tiers.names[<uint32_t>b.holders()[j]])
                    for j in range(b.n)
                ]
            for kv in m.pods:
                p = kv.second
                tiers = {}
                self.core.pod_keys(p, a, c)
                for j in range(a.size()):
                    for s in range(p.ntiers):
                        if c[j] & (1ULL << s):
                            tiers.setdefault(self.tiers.names[p.tier_ids[s]], set()).add(a[j])
                self.core.pod_links(p, a, c)
                links = {a[j]: c[j] for j in range(a.size())}
                self.core.pod_engine(p, a, c)
                engine = {a[j]: c[j] for j in range(a.size())}
                pods[(model, self.pods.names[kv.first])] = {"tiers": tiers, "links": links, "engine": engine}
        return {"blocks": blocks, "pods": pods}

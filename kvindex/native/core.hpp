// The in-memory index's maps in C++: what kvindex/memory.py's PyCore keeps in dicts and sets,
// with the same invariants and the same bounds, behind the same calls (kvindex/native/_native.pyx
// turns Python objects into the ids and arrays used here). Models, pods and tiers are small ids
// the caller interns. Not thread-safe: MemoryIndex calls it under its lock.
//
// State:
//  * blocks_: a slab of Block, one per (model, key), linked in least-recently-used order
//    (lru_head_ oldest); Model::blocks maps a key to its slot.
//  * a Block's holders: (pod << 32 | tier) codes, oldest first, at most pod_cache_size.
//  * Model::pods[pod] -> Pod: PodKey per key the pod holds (a bit per tier it holds it on, over
//    the pod's own table of at most 64 tiers, and the engine hashes that point at the key), the
//    engine map (engine hash -> digest) and the count of keys per tier.
//
// Invariants (drop_entry is the one place an entry leaves):
//  * holder (pod, tier) in blocks[(model, key)] iff the pod's PodKey for key has tier's bit;
//  * every engine hash of a pod maps to a digest whose key the pod holds (PodKey.tiers != 0),
//    and is linked from that PodKey; no empty Block, PodKey, Pod;
//  * bytes_ is the cost model (KEY/HOLDER/ENGINE_ENTRY_BYTES) summed over the entries.
#ifndef KVINDEX_CORE_HPP
#define KVINDEX_CORE_HPP

#include <cstdint>
#include <cstring>
#include <unordered_map>
#include <utility>
#include <vector>

#include "flatmap.hpp"

namespace kvn {

static const uint32_t NIL = 0xffffffffu;
static const int MAX_POD_TIERS = 64;
static const int DIGEST_MAX = 32;

struct Block {
    uint64_t key;
    uint32_t model;
    uint32_t prev, next;  // LRU links (slab indices); a free block's next links the free list
    uint32_t n, cap;      // holders; cap <= 1 keeps the one holder inline
    union {
        uint64_t one;
        uint64_t *many;
    } h;
    uint64_t *holders() { return cap <= 1 ? &h.one : h.many; }
};

struct Digest {
    uint8_t len;
    uint8_t d[DIGEST_MAX];
};

struct PodKey {
    uint64_t tiers;  // bits over Pod::tier_ids
    uint64_t hash0;  // the first engine hash pointing at this key, when nhash >= 1
    uint32_t nhash;  // engine hashes pointing at it; beyond the first, in Pod::extra
};

struct Pod {
    FlatMap<PodKey> keys;
    FlatMap<Digest> engine;
    std::unordered_map<uint64_t, std::vector<uint64_t>> extra;
    uint32_t tier_ids[MAX_POD_TIERS];
    uint64_t tier_keys[MAX_POD_TIERS];
    int ntiers = 0;
    uint64_t entries = 0;  // (key, tier) entries
};

struct Model {
    FlatMap<uint32_t> blocks;
    std::unordered_map<uint32_t, Pod *> pods;
};

inline void set_hash_seed(uint64_t seed) { hash_seed = seed; }

inline uint64_t digest_key(const uint8_t *d, int len) {
    uint64_t key = 0;
    for (int i = len > 8 ? len - 8 : 0; i < len; i++) key = (key << 8) | d[i];
    return key;
}

inline uint64_t holder_code(uint32_t pod, uint32_t tier) { return (uint64_t)pod << 32 | tier; }

// The cost model: bytes per entry, a table slot counted at the mean load of a table kept between
// 3/8 and 3/4 full (9/16).
static const int64_t KEY_ENTRY_BYTES = sizeof(Block) + (8 + 4 + 1) * 16 / 9;
static const int64_t HOLDER_ENTRY_BYTES = 8 + (8 + sizeof(PodKey) + 1) * 16 / 9;
static const int64_t ENGINE_ENTRY_BYTES = (8 + sizeof(Digest) + 1) * 16 / 9;

class Core {
   public:
    uint64_t max_keys;
    uint32_t pod_cache_size;
    int64_t max_bytes;  // < 0: none
    int64_t bytes_ = 0;
    uint64_t nkeys_ = 0;
    uint64_t refused_tiers = 0;  // blocks not stored: their pod already held 64 other tiers

    Core(uint64_t max_keys, uint32_t pod_cache_size, int64_t max_bytes)
        : max_keys(max_keys), pod_cache_size(pod_cache_size), max_bytes(max_bytes) {}
    Core(const Core &) = delete;
    Core &operator=(const Core &) = delete;
    ~Core() { close(); }

    size_t model_count() const { return models_.size(); }
    Model *model(uint32_t id) { return id < models_.size() ? models_[id] : nullptr; }

    Pod *pod(uint32_t model_id, uint32_t pod_id) {
        Model *m = model(model_id);
        if (!m) return nullptr;
        auto it = m->pods.find(pod_id);
        return it == m->pods.end() ? nullptr : it->second;
    }

    Block *block(uint32_t model_id, uint64_t key) {
        Model *m = model(model_id);
        if (!m) return nullptr;
        uint32_t *idx = m->blocks.find(key);
        return idx ? &blocks_[*idx] : nullptr;
    }

    void touch(Block *b) {
        uint32_t idx = (uint32_t)(b - blocks_.data());
        lru_unlink(idx);
        lru_append(idx);
    }

    int tier_slot(Pod *p, uint32_t tier) const {
        for (int s = 0; s < p->ntiers; s++)
            if (p->tier_ids[s] == tier) return s;
        return -1;
    }

    // -- writes ------------------------------------------------------------------------------

    void store(uint32_t model_id, uint32_t pod_id, uint32_t tier, size_t n, const uint64_t *keys,
               const uint64_t *hashes, const Digest *digests) {
        if (!n) return;
        while (models_.size() <= model_id) models_.push_back(nullptr);
        if (!models_[model_id]) models_[model_id] = new Model();
        Model *m = models_[model_id];
        Pod *&slot_ref = m->pods[pod_id];
        if (!slot_ref) slot_ref = new Pod();
        Pod *p = slot_ref;
        int s = tier_slot(p, tier);
        if (s < 0) {
            if (p->ntiers == MAX_POD_TIERS) {
                refused_tiers += n;
                drop_if_empty(m, pod_id, p);
                return;
            }
            s = p->ntiers++;
            p->tier_ids[s] = tier;
            p->tier_keys[s] = 0;
        }
        uint64_t bit = 1ULL << s;
        uint64_t code = holder_code(pod_id, tier);
        for (size_t i = 0; i < n; i++) {
            uint64_t key = keys[i];
            const Digest &dig = digests[i];
            bool inserted;
            PodKey *pk = p->keys.slot(key, &inserted);
            Digest *old = p->engine.slot(hashes[i], &inserted);
            if (inserted || old->len != dig.len || std::memcmp(old->d, dig.d, dig.len) != 0) {
                uint64_t old_key = digest_key(old->d, old->len);
                bool repointed = !inserted && old_key != key;
                *old = dig;
                if (inserted) bytes_ += ENGINE_ENTRY_BYTES;
                if (repointed) {
                    unlink_hash(p, old_key, hashes[i]);  // may move the pod's keys: find it again
                    pk = p->keys.slot(key, &inserted);
                }
                link_hash(p, pk, key, hashes[i]);
            }
            uint32_t *slot = m->blocks.slot(key, &inserted);
            uint32_t idx;
            if (inserted) {
                idx = alloc_block(key, model_id);
                *slot = idx;
                lru_append(idx);
                bytes_ += KEY_ENTRY_BYTES;
                nkeys_++;
            } else {
                idx = *slot;
                lru_unlink(idx);
                lru_append(idx);
                remove_holder(blocks_[idx], code);
            }
            add_holder(blocks_[idx], code);
            if (!(pk->tiers & bit)) {
                pk->tiers |= bit;
                p->tier_keys[s]++;
                p->entries++;
                bytes_ += HOLDER_ENTRY_BYTES;
            }
            if (blocks_[idx].n > pod_cache_size) {
                // The oldest holder, never the one just added: it is last and the bound is >= 1.
                drop_entry(model_id, idx, blocks_[idx].holders()[0]);
            }
        }
        while (nkeys_ > max_keys || (max_bytes >= 0 && bytes_ > max_bytes && nkeys_)) evict_oldest();
    }

    // Engine hashes of (pod, tier) dropped: how many entries went.
    size_t remove(uint32_t model_id, uint32_t pod_id, uint32_t tier, size_t n, const uint64_t *hashes) {
        Model *m = model(model_id);
        if (!m) return 0;
        uint64_t code = holder_code(pod_id, tier);
        size_t removed = 0;
        for (size_t i = 0; i < n; i++) {
            Pod *p = pod(model_id, pod_id);
            if (!p) break;  // the pod holds nothing (any more): every hash is unknown
            Digest *dig = p->engine.find(hashes[i]);
            if (!dig) continue;
            uint32_t *idx = m->blocks.find(digest_key(dig->d, dig->len));
            if (idx && has_holder(blocks_[*idx], code)) {
                drop_entry(model_id, *idx, code);
                removed++;
            }
        }
        return removed;
    }

    // At most `limit` (>= 1) of the pod's entries under one model; *done when the pod is gone.
    size_t clear_pod_slice(uint32_t model_id, uint32_t pod_id, uint64_t limit, bool *done) {
        Pod *p = pod(model_id, pod_id);
        if (!p) {
            *done = true;
            return 0;
        }
        Model *m = models_[model_id];
        if (p->entries <= limit) {
            *done = true;
            return clear_pod(m, model_id, pod_id, p);
        }
        std::vector<std::pair<uint64_t, uint32_t>> part;  // (key, tier)
        p->keys.each([&](uint64_t key, const PodKey &pk) {
            for (int s = 0; s < p->ntiers && part.size() < limit; s++)
                if (pk.tiers & (1ULL << s)) part.emplace_back(key, p->tier_ids[s]);
        });
        for (auto &kt : part) drop_entry(model_id, *m->blocks.find(kt.first), holder_code(pod_id, kt.second));
        *done = false;
        return part.size();
    }

    void close() {
        for (Model *m : models_) {
            if (!m) continue;
            for (auto &kv : m->pods) delete kv.second;
            delete m;
        }
        models_.clear();
        for (Block &b : blocks_)
            if (b.cap > 1) std::free(b.h.many);
        blocks_.clear();
        blocks_.shrink_to_fit();
        free_ = lru_head_ = lru_tail_ = NIL;
        bytes_ = 0;
        nkeys_ = 0;
    }

    int64_t recount_bytes() {
        int64_t total = 0;
        for (Model *m : models_) {
            if (!m) continue;
            m->blocks.each([&](uint64_t, const uint32_t &idx) {
                total += KEY_ENTRY_BYTES + HOLDER_ENTRY_BYTES * blocks_[idx].n;
            });
            for (auto &kv : m->pods) total += ENGINE_ENTRY_BYTES * (int64_t)kv.second->engine.size();
        }
        return total;
    }

    // Table bytes actually allocated (blocks slab and every map), for the benchmarks.
    size_t allocated_bytes() {
        size_t total = blocks_.capacity() * sizeof(Block);
        for (Model *m : models_) {
            if (!m) continue;
            total += sizeof(Model) + m->blocks.bytes();
            for (auto &kv : m->pods) total += sizeof(Pod) + kv.second->keys.bytes() + kv.second->engine.bytes();
        }
        return total;
    }

    // Engine hashes pointing at a key the pod holds, for invariant checks: hash0 then extra.
    void hashes_of(Pod *p, uint64_t key, const PodKey &pk, std::vector<uint64_t> &out) {
        out.clear();
        if (pk.nhash >= 1) out.push_back(pk.hash0);
        if (pk.nhash > 1) {
            auto it = p->extra.find(key);
            if (it != p->extra.end()) out.insert(out.end(), it->second.begin(), it->second.end());
        }
    }

    // Flat views for the Python side, which cannot walk a FlatMap.
    void model_blocks(Model *m, std::vector<uint32_t> &out) {
        out.clear();
        m->blocks.each([&](uint64_t, const uint32_t &idx) { out.push_back(idx); });
    }
    Block *block_at(uint32_t idx) { return &blocks_[idx]; }
    Digest *engine_digest(Pod *p, uint64_t hash) { return p->engine.find(hash); }
    void pod_keys(Pod *p, std::vector<uint64_t> &keys, std::vector<uint64_t> &tiers) {
        keys.clear();
        tiers.clear();
        p->keys.each([&](uint64_t key, const PodKey &pk) {
            keys.push_back(key);
            tiers.push_back(pk.tiers);
        });
    }
    void pod_links(Pod *p, std::vector<uint64_t> &hashes, std::vector<uint64_t> &keys) {
        hashes.clear();
        keys.clear();
        std::vector<uint64_t> some;
        p->keys.each([&](uint64_t key, const PodKey &pk) {
            hashes_of(p, key, pk, some);
            for (uint64_t h : some) {
                hashes.push_back(h);
                keys.push_back(key);
            }
        });
    }
    void pod_engine(Pod *p, std::vector<uint64_t> &hashes, std::vector<uint64_t> &keys) {
        hashes.clear();
        keys.clear();
        p->engine.each([&](uint64_t h, const Digest &d) {
            hashes.push_back(h);
            keys.push_back(digest_key(d.d, d.len));
        });
    }

   private:
    std::vector<Model *> models_;
    std::vector<Block> blocks_;
    uint32_t free_ = NIL, lru_head_ = NIL, lru_tail_ = NIL;

    uint32_t alloc_block(uint64_t key, uint32_t model_id) {
        uint32_t idx;
        if (free_ != NIL) {
            idx = free_;
            free_ = blocks_[idx].next;
        } else {
            idx = (uint32_t)blocks_.size();
            blocks_.emplace_back();
        }
        Block &b = blocks_[idx];
        b.key = key;
        b.model = model_id;
        b.n = 0;
        b.cap = 1;
        b.h.one = 0;
        return idx;
    }

    void free_block(uint32_t idx) {
        Block &b = blocks_[idx];
        if (b.cap > 1) std::free(b.h.many);
        b.cap = 0;
        b.n = 0;
        b.next = free_;
        free_ = idx;
    }

    void lru_append(uint32_t idx) {
        Block &b = blocks_[idx];
        b.prev = lru_tail_;
        b.next = NIL;
        if (lru_tail_ != NIL) blocks_[lru_tail_].next = idx;
        else lru_head_ = idx;
        lru_tail_ = idx;
    }

    void lru_unlink(uint32_t idx) {
        Block &b = blocks_[idx];
        if (b.prev != NIL) blocks_[b.prev].next = b.next;
        else lru_head_ = b.next;
        if (b.next != NIL) blocks_[b.next].prev = b.prev;
        else lru_tail_ = b.prev;
    }

    static bool has_holder(Block &b, uint64_t code) {
        uint64_t *hs = b.holders();
        for (uint32_t i = 0; i < b.n; i++)
            if (hs[i] == code) return true;
        return false;
    }

    static void add_holder(Block &b, uint64_t code) {
        if (b.n == b.cap) {
            uint32_t cap = b.cap < 2 ? 4 : b.cap * 2;
            uint64_t *many = static_cast<uint64_t *>(std::malloc(cap * sizeof(uint64_t)));
            if (!many) throw std::bad_alloc();
            std::memcpy(many, b.holders(), b.n * sizeof(uint64_t));
            if (b.cap > 1) std::free(b.h.many);
            b.h.many = many;
            b.cap = cap;
        }
        b.holders()[b.n++] = code;
    }

    static bool remove_holder(Block &b, uint64_t code) {
        uint64_t *hs = b.holders();
        for (uint32_t i = 0; i < b.n; i++) {
            if (hs[i] != code) continue;
            std::memmove(hs + i, hs + i + 1, (b.n - i - 1) * sizeof(uint64_t));
            b.n--;
            return true;
        }
        return false;
    }

    void link_hash(Pod *p, PodKey *pk, uint64_t key, uint64_t hash) {
        if (pk->nhash == 0) {
            pk->hash0 = hash;
            pk->nhash = 1;
            return;
        }
        if (pk->hash0 == hash) return;
        std::vector<uint64_t> &more = p->extra[key];
        for (uint64_t h : more)
            if (h == hash) return;
        more.push_back(hash);
        pk->nhash++;
    }

    void unlink_hash(Pod *p, uint64_t key, uint64_t hash) {
        PodKey *pk = p->keys.find(key);
        if (!pk || pk->nhash == 0) return;
        auto it = pk->nhash > 1 ? p->extra.find(key) : p->extra.end();
        if (pk->hash0 == hash) {
            if (it != p->extra.end() && !it->second.empty()) {
                pk->hash0 = it->second.back();
                it->second.pop_back();
            }
            pk->nhash--;
        } else if (it != p->extra.end()) {
            auto &more = it->second;
            for (size_t i = 0; i < more.size(); i++) {
                if (more[i] != hash) continue;
                more[i] = more.back();
                more.pop_back();
                pk->nhash--;
                break;
            }
        }
        if (it != p->extra.end() && it->second.empty()) p->extra.erase(it);
        if (pk->nhash == 0 && pk->tiers == 0) p->keys.erase(key);
    }

    // Remove holder `code` from block idx and from the pod's reverse index; when the pod no
    // longer holds the key on any tier, its engine hashes for the key go too. Deletes what
    // becomes empty. Requires the holder in the block.
    void drop_entry(uint32_t model_id, uint32_t idx, uint64_t code) {
        Model *m = models_[model_id];
        Block &b = blocks_[idx];
        uint64_t key = b.key;
        remove_holder(b, code);
        bytes_ -= HOLDER_ENTRY_BYTES;
        if (b.n == 0) {
            m->blocks.erase(key);
            lru_unlink(idx);
            free_block(idx);
            bytes_ -= KEY_ENTRY_BYTES;
            nkeys_--;
        }
        uint32_t pod_id = (uint32_t)(code >> 32);
        Pod *p = m->pods[pod_id];
        int s = tier_slot(p, (uint32_t)code);
        PodKey *pk = p->keys.find(key);
        pk->tiers &= ~(1ULL << s);
        p->tier_keys[s]--;
        p->entries--;
        if (pk->tiers == 0) {
            if (pk->nhash >= 1) {
                p->engine.erase(pk->hash0);
                bytes_ -= ENGINE_ENTRY_BYTES;
            }
            if (pk->nhash > 1) {
                auto it = p->extra.find(key);
                for (uint64_t h : it->second) {
                    p->engine.erase(h);
                    bytes_ -= ENGINE_ENTRY_BYTES;
                }
                p->extra.erase(it);
            }
            p->keys.erase(key);
        }
        drop_if_empty(m, pod_id, p);
    }

    void drop_if_empty(Model *m, uint32_t pod_id, Pod *p) {
        if (p->entries || p->keys.size()) return;
        bytes_ -= ENGINE_ENTRY_BYTES * (int64_t)p->engine.size();  // none, by the invariants
        delete p;
        m->pods.erase(pod_id);
    }

    size_t clear_pod(Model *m, uint32_t model_id, uint32_t pod_id, Pod *p) {
        size_t removed = 0;
        p->keys.each([&](uint64_t key, const PodKey &pk) {
            uint32_t *idx = m->blocks.find(key);
            if (!idx) return;  // never: the pod holds the key, so its block exists
            for (int s = 0; s < p->ntiers; s++) {
                if (!(pk.tiers & (1ULL << s))) continue;
                Block &b = blocks_[*idx];
                remove_holder(b, holder_code(pod_id, p->tier_ids[s]));
                bytes_ -= HOLDER_ENTRY_BYTES;
                removed++;
            }
            if (blocks_[*idx].n == 0) {
                uint32_t i = *idx;
                m->blocks.erase(key);
                lru_unlink(i);
                free_block(i);
                bytes_ -= KEY_ENTRY_BYTES;
                nkeys_--;
            }
        });
        bytes_ -= ENGINE_ENTRY_BYTES * (int64_t)p->engine.size();
        delete p;
        m->pods.erase(pod_id);
        return removed;
    }

    void evict_oldest() {
        uint32_t idx = lru_head_;
        Block &b = blocks_[idx];
        uint32_t model_id = b.model;
        // Each drop removes the first holder; the last one frees the block.
        while (blocks_[idx].n) drop_entry(model_id, idx, blocks_[idx].holders()[0]);
    }
};

}  // namespace kvn

#endif

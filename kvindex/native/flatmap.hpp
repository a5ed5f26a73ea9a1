// FlatMap<V>: a hash map from uint64 to a trivially copyable V, open addressing with linear
// probing and backward-shift deletion (no tombstones), power-of-two capacity, at most 3/4 full,
// halved when it falls under 1/8 full. Keys are mixed with a per-process random seed before
// probing, so keys chosen by an engine (its block hashes) cannot be lined up to collide.
//
// Pointers into the map (find, slot) are valid until the next insertion or erasure.
#ifndef KVINDEX_FLATMAP_HPP
#define KVINDEX_FLATMAP_HPP

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <type_traits>

namespace kvn {

// Set once, before any map is used, from os.urandom (kvindex/native/_native.pyx).
inline uint64_t hash_seed = 0;

inline uint64_t mix64(uint64_t x) {
    x ^= hash_seed;
    x += 0x9e3779b97f4a7c15ULL;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

template <typename V>
class FlatMap {
    static_assert(std::is_trivially_copyable<V>::value, "FlatMap values are moved with memcpy");

   public:
    FlatMap() = default;
    FlatMap(const FlatMap &) = delete;
    FlatMap &operator=(const FlatMap &) = delete;
    ~FlatMap() { release(); }

    size_t size() const { return size_; }
    size_t capacity() const { return mask_ ? mask_ + 1 : 0; }

    V *find(uint64_t key) {
        if (!size_) return nullptr;
        for (size_t i = mix64(key) & mask_;; i = (i + 1) & mask_) {
            if (!used_[i]) return nullptr;
            if (keys_[i] == key) return &vals_[i];
        }
    }

    // The value of `key`, inserted value-initialized (all zero) when absent.
    V *slot(uint64_t key, bool *inserted) {
        if ((size_ + 1) * 4 > capacity() * 3) resize(capacity() ? capacity() * 2 : 8);
        size_t i = mix64(key) & mask_;
        for (; used_[i]; i = (i + 1) & mask_) {
            if (keys_[i] == key) {
                *inserted = false;
                return &vals_[i];
            }
        }
        used_[i] = 1;
        keys_[i] = key;
        vals_[i] = V();
        size_++;
        *inserted = true;
        return &vals_[i];
    }

    bool erase(uint64_t key) {
        if (!size_) return false;
        size_t i = mix64(key) & mask_;
        for (;; i = (i + 1) & mask_) {
            if (!used_[i]) return false;
            if (keys_[i] == key) break;
        }
        used_[i] = 0;
        size_--;
        // Shift back every entry after the hole that may not sit between its home and the hole.
        for (size_t j = (i + 1) & mask_; used_[j]; j = (j + 1) & mask_) {
            size_t home = mix64(keys_[j]) & mask_;
            bool stays = (i <= j) ? (i < home && home <= j) : (i < home || home <= j);
            if (stays) continue;
            keys_[i] = keys_[j];
            vals_[i] = vals_[j];
            used_[i] = 1;
            used_[j] = 0;
            i = j;
        }
        if (capacity() > 8 && size_ * 8 < capacity()) resize(capacity() / 2);
        return true;
    }

    template <typename F>
    void each(F f) const {
        for (size_t i = 0; i < capacity(); i++)
            if (used_[i]) f(keys_[i], vals_[i]);
    }

    void clear() {
        release();
        size_ = 0;
    }

    size_t bytes() const { return capacity() * (sizeof(uint64_t) + sizeof(V) + 1); }

   private:
    uint64_t *keys_ = nullptr;
    V *vals_ = nullptr;
    uint8_t *used_ = nullptr;
    size_t mask_ = 0;
    size_t size_ = 0;

    void release() {
        std::free(keys_);
        std::free(vals_);
        std::free(used_);
        keys_ = nullptr;
        vals_ = nullptr;
        used_ = nullptr;
        mask_ = 0;
    }

    void resize(size_t cap) {
        uint64_t *keys = static_cast<uint64_t *>(std::malloc(cap * sizeof(uint64_t)));
        V *vals = static_cast<V *>(std::malloc(cap * sizeof(V)));
        uint8_t *used = static_cast<uint8_t *>(std::calloc(cap, 1));
        if (!keys || !vals || !used) {
            std::free(keys);
            std::free(vals);
            std::free(used);
            throw std::bad_alloc();
        }
        size_t mask = cap - 1;
        for (size_t i = 0; i < capacity(); i++) {
            if (!used_[i]) continue;
            size_t j = mix64(keys_[i]) & mask;
            while (used[j]) j = (j + 1) & mask;
            used[j] = 1;
            keys[j] = keys_[i];
            std::memcpy(&vals[j], &vals_[i], sizeof(V));
        }
        release();
        keys_ = keys;
        vals_ = vals;
        used_ = used;
        mask_ = mask;
    }
};

}  // namespace kvn

#endif

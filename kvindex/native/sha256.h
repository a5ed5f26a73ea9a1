/* SHA-256 (FIPS 180-4), one-shot, for the block-key chain: a block's canonical CBOR is hashed
 * whole. Two implementations: OpenSSL's (libcrypto, the library Python's hashlib already loaded,
 * found with dlopen, so no headers are needed; it uses the CPU's SHA instructions) when
 * kv_sha256_use_openssl() finds it, else the portable one below. Both are checked against
 * hashlib by tests/kvindex/test_native.py. */
#ifndef KVINDEX_SHA256_H
#define KVINDEX_SHA256_H

#include <stddef.h>
#include <stdint.h>
#include <dlfcn.h>
#include <string.h>

static const uint32_t kv_sha256_k[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

#define KV_ROTR(x, n) (((x) >> (n)) | ((x) << (32 - (n))))

static inline void kv_sha256_block(uint32_t state[8], const uint8_t *p) {
    uint32_t w[64];
    for (int i = 0; i < 16; i++)
        w[i] = ((uint32_t)p[4 * i] << 24) | ((uint32_t)p[4 * i + 1] << 16) |
               ((uint32_t)p[4 * i + 2] << 8) | (uint32_t)p[4 * i + 3];
    for (int i = 16; i < 64; i++) {
        uint32_t s0 = KV_ROTR(w[i - 15], 7) ^ KV_ROTR(w[i - 15], 18) ^ (w[i - 15] >> 3);
        uint32_t s1 = KV_ROTR(w[i - 2], 17) ^ KV_ROTR(w[i - 2], 19) ^ (w[i - 2] >> 10);
        w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    uint32_t a = state[0], b = state[1], c = state[2], d = state[3];
    uint32_t e = state[4], f = state[5], g = state[6], h = state[7];
    for (int i = 0; i < 64; i++) {
        uint32_t s1 = KV_ROTR(e, 6) ^ KV_ROTR(e, 11) ^ KV_ROTR(e, 25);
        uint32_t ch = (e & f) ^ (~e & g);
        uint32_t t1 = h + s1 + ch + kv_sha256_k[i] + w[i];
        uint32_t s0 = KV_ROTR(a, 2) ^ KV_ROTR(a, 13) ^ KV_ROTR(a, 22);
        uint32_t maj = (a & b) ^ (a & c) ^ (b & c);
        uint32_t t2 = s0 + maj;
        h = g; g = f; f = e; e = d + t1;
        d = c; c = b; b = a; a = t1 + t2;
    }
    state[0] += a; state[1] += b; state[2] += c; state[3] += d;
    state[4] += e; state[5] += f; state[6] += g; state[7] += h;
}

/* out = SHA-256(data[0:len]), portable. */
static inline void kv_sha256_portable(const uint8_t *data, size_t len, uint8_t out[32]) {
    uint32_t state[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                         0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    size_t full = len / 64;
    for (size_t i = 0; i < full; i++) kv_sha256_block(state, data + 64 * i);
    uint8_t last[128];
    size_t rest = len - 64 * full;
    memcpy(last, data + 64 * full, rest);
    last[rest] = 0x80;
    size_t padded = rest + 9 <= 64 ? 64 : 128;
    memset(last + rest + 1, 0, padded - rest - 1);
    uint64_t bits = (uint64_t)len * 8;
    for (int i = 0; i < 8; i++) last[padded - 1 - i] = (uint8_t)(bits >> (8 * i));
    kv_sha256_block(state, last);
    if (padded == 128) kv_sha256_block(state, last + 64);
    for (int i = 0; i < 8; i++) {
        out[4 * i] = (uint8_t)(state[i] >> 24);
        out[4 * i + 1] = (uint8_t)(state[i] >> 16);
        out[4 * i + 2] = (uint8_t)(state[i] >> 8);
        out[4 * i + 3] = (uint8_t)state[i];
    }
}


/* OpenSSL's low-level SHA-256, resolved at run time: SHA256_CTX is 112 bytes in every OpenSSL. */
typedef int (*kv_sha_init_fn)(void *);
typedef int (*kv_sha_update_fn)(void *, const void *, size_t);
typedef int (*kv_sha_final_fn)(unsigned char *, void *);
static kv_sha_init_fn kv_sha_init = NULL;
static kv_sha_update_fn kv_sha_update = NULL;
static kv_sha_final_fn kv_sha_final = NULL;

static inline void kv_sha256(const uint8_t *data, size_t len, uint8_t out[32]) {
    if (kv_sha_final) {
        uint64_t ctx[32]; /* 256 bytes, aligned: room for SHA256_CTX */
        kv_sha_init(ctx);
        kv_sha_update(ctx, data, len);
        kv_sha_final(out, ctx);
        return;
    }
    kv_sha256_portable(data, len, out);
}

/* Use libcrypto's SHA-256 if `soname` loads and hashes a test vector as the portable one does;
 * returns 1 if it is used from now on. */
static inline int kv_sha256_use_openssl(const char *soname) {
    void *lib = dlopen(soname, RTLD_NOW | RTLD_LOCAL);
    if (!lib) return 0;
    kv_sha_init_fn init = (kv_sha_init_fn)dlsym(lib, "SHA256_Init");
    kv_sha_update_fn update = (kv_sha_update_fn)dlsym(lib, "SHA256_Update");
    kv_sha_final_fn final = (kv_sha_final_fn)dlsym(lib, "SHA256_Final");
    if (!init || !update || !final) return 0;
    uint8_t data[200], want[32], got[32];
    for (int i = 0; i < 200; i++) data[i] = (uint8_t)(i * 7 + 3);
    for (size_t n = 0; n <= 200; n += 37) {
        uint64_t ctx[32];
        kv_sha256_portable(data, n, want);
        init(ctx);
        update(ctx, data, n);
        final(got, ctx);
        if (memcmp(want, got, 32) != 0) return 0;
    }
    kv_sha_init = init;
    kv_sha_update = update;
    kv_sha_final = final;
    return 1;
}

#endif

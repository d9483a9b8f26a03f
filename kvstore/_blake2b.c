/* BLAKE2b-256 over arrays of keys in one call each, the GIL released (written from RFC 7693).
 *
 * keyed_hash: a tenant's namespace (kvstore/tenants.py). Every key a client sends is replaced
 *   by BLAKE2b-256(key = the tenant's salt, data = the key) before any index, file or directory
 *   sees it. The salt's block is compressed once per call, each key then takes one compression.
 * chain_keys: the chained block keys of a prompt (kvstore/keys.py). key(i) = BLAKE2b-256(prefix
 *   | key(i-1) | the block's 128 token ids as little-endian uint32).
 *
 * hashlib computes the same digests (the tests compare them), but one Python call per key or
 * block: 1,000 keys took ~0.75 ms, the blocks of a 1M-token prompt ~110 ms holding the GIL —
 * which stalled the gateway's event loop for everyone. Pure functions, no state.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static const uint64_t IV[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL, 0xa54ff53a5f1d36f1ULL,
    0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL, 0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL,
};

static const uint8_t SIGMA[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
};

static inline uint64_t
rotr64(uint64_t x, int n)
{
    return (x >> n) | (x << (64 - n));
}

static inline uint64_t
load64(const uint8_t *p)
{
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    uint64_t v;
    memcpy(&v, p, 8); /* the word as BLAKE2b reads it: little-endian, like this host */
    return v;
#else
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
#endif
}

#define G(a, b, c, d, x, y)                                                                     \
    do {                                                                                        \
        v[a] = v[a] + v[b] + (x);                                                               \
        v[d] = rotr64(v[d] ^ v[a], 32);                                                         \
        v[c] = v[c] + v[d];                                                                     \
        v[b] = rotr64(v[b] ^ v[c], 24);                                                         \
        v[a] = v[a] + v[b] + (y);                                                               \
        v[d] = rotr64(v[d] ^ v[a], 16);                                                         \
        v[c] = v[c] + v[d];                                                                     \
        v[b] = rotr64(v[b] ^ v[c], 63);                                                         \
    } while (0)

/* One compression of a 128-byte block into h; t = bytes hashed so far (< 2**64 here). */
static void
compress(uint64_t h[8], const uint8_t block[128], uint64_t t, int last)
{
    uint64_t m[16], v[16];
    for (int i = 0; i < 16; i++)
        m[i] = load64(block + 8 * i);
    for (int i = 0; i < 8; i++) {
        v[i] = h[i];
        v[i + 8] = IV[i];
    }
    v[12] ^= t;
    if (last)
        v[14] = ~v[14];
    for (int r = 0; r < 12; r++) {
        const uint8_t *s = SIGMA[r];
        G(0, 4, 8, 12, m[s[0]], m[s[1]]);
        G(1, 5, 9, 13, m[s[2]], m[s[3]]);
        G(2, 6, 10, 14, m[s[4]], m[s[5]]);
        G(3, 7, 11, 15, m[s[6]], m[s[7]]);
        G(0, 5, 10, 15, m[s[8]], m[s[9]]);
        G(1, 6, 11, 12, m[s[10]], m[s[11]]);
        G(2, 7, 8, 13, m[s[12]], m[s[13]]);
        G(3, 4, 9, 14, m[s[14]], m[s[15]]);
    }
    for (int i = 0; i < 8; i++)
        h[i] ^= v[i] ^ v[i + 8];
}

static PyObject *
keyed_hash(PyObject *self, PyObject *args)
{
    Py_buffer salt, keys, out;
    if (!PyArg_ParseTuple(args, "y*y*w*", &salt, &keys, &out))
        return NULL;
    PyObject *result = NULL;
    if (salt.len < 1 || salt.len > 64 || keys.len % 32 || out.len != keys.len) {
        PyErr_SetString(PyExc_ValueError,
                        "keyed_hash: a 1-64 byte salt, n 32-byte keys and n*32 bytes out expected");
        goto done;
    }
    const Py_ssize_t n = keys.len / 32;
    const uint8_t *in = (const uint8_t *)keys.buf;
    uint8_t *o = (uint8_t *)out.buf;
    uint8_t block[128];
    uint64_t keyed[8];
    /* Parameter block: digest 32 bytes, key length, fanout 1, depth 1. */
    for (int i = 0; i < 8; i++)
        keyed[i] = IV[i];
    keyed[0] ^= 0x01010000ULL ^ ((uint64_t)salt.len << 8) ^ 32ULL;
    memset(block, 0, sizeof block);
    memcpy(block, salt.buf, (size_t)salt.len);
    Py_BEGIN_ALLOW_THREADS
    compress(keyed, block, 128, 0); /* the salt, padded to one block: the same for every key */
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t h[8];
        memcpy(h, keyed, sizeof h);
        memset(block, 0, sizeof block);
        memcpy(block, in + 32 * i, 32);
        compress(h, block, 128 + 32, 1);
        for (int w = 0; w < 4; w++)
            for (int b = 0; b < 8; b++)
                o[32 * i + 8 * w + b] = (uint8_t)(h[w] >> (8 * b));
    }
    Py_END_ALLOW_THREADS
    Py_INCREF(Py_None);
    result = Py_None;
done:
    PyBuffer_Release(&out);
    PyBuffer_Release(&keys);
    PyBuffer_Release(&salt);
    return result;
}

/* Unkeyed BLAKE2b-256 of data[0:len] into out. */
static void
digest256(const uint8_t *data, size_t len, uint8_t out[32])
{
    uint64_t h[8];
    uint8_t block[128];
    for (int i = 0; i < 8; i++)
        h[i] = IV[i];
    h[0] ^= 0x01010000ULL ^ 32ULL; /* digest 32 bytes, no key, fanout 1, depth 1 */
    uint64_t done = 0;
    while (len - done > 128) {
        compress(h, data + done, done + 128, 0);
        done += 128;
    }
    memset(block, 0, sizeof block);
    memcpy(block, data + done, len - done);
    compress(h, block, len, 1);
    for (int w = 0; w < 4; w++)
        for (int b = 0; b < 8; b++)
            out[8 * w + b] = (uint8_t)(h[w] >> (8 * b));
}

#define MAX_PREFIX 1024
#define BLOCK_TOKEN_BYTES (128 * 4)

static PyObject *
chain_keys(PyObject *self, PyObject *args)
{
    Py_buffer prefix, parent, tokens, out;
    if (!PyArg_ParseTuple(args, "y*y*y*w*", &prefix, &parent, &tokens, &out))
        return NULL;
    PyObject *result = NULL;
    if (prefix.len > MAX_PREFIX || parent.len != 32 || tokens.len % BLOCK_TOKEN_BYTES ||
        out.len != tokens.len / BLOCK_TOKEN_BYTES * 32) {
        PyErr_SetString(PyExc_ValueError,
                        "chain_keys: a prefix of at most 1024 bytes, a 32-byte parent, whole "
                        "blocks of 128 uint32 token ids and 32 bytes out per block expected");
        goto done;
    }
    const Py_ssize_t n = tokens.len / BLOCK_TOKEN_BYTES;
    const size_t p = (size_t)prefix.len;
    uint8_t message[MAX_PREFIX + 32 + BLOCK_TOKEN_BYTES];
    memcpy(message, prefix.buf, p);
    memcpy(message + p, parent.buf, 32);
    uint8_t *o = (uint8_t *)out.buf;
    const uint8_t *in = (const uint8_t *)tokens.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        memcpy(message + p + 32, in + BLOCK_TOKEN_BYTES * i, BLOCK_TOKEN_BYTES);
        digest256(message, p + 32 + BLOCK_TOKEN_BYTES, o + 32 * i);
        memcpy(message + p, o + 32 * i, 32); /* this block's key is the next one's parent */
    }
    Py_END_ALLOW_THREADS
    Py_INCREF(Py_None);
    result = Py_None;
done:
    PyBuffer_Release(&out);
    PyBuffer_Release(&tokens);
    PyBuffer_Release(&parent);
    PyBuffer_Release(&prefix);
    return result;
}

static PyMethodDef methods[] = {
    {"keyed_hash", keyed_hash, METH_VARARGS,
     "keyed_hash(salt, keys, out): out[i] = BLAKE2b-256(key=salt, data=keys[i]) for 32-byte keys."},
    {"chain_keys", chain_keys, METH_VARARGS,
     "chain_keys(prefix, parent, tokens, out): out[i] = BLAKE2b-256(prefix | out[i-1] | "
     "tokens[i]), out[-1] = parent, for blocks of 128 little-endian uint32 token ids."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvstore._blake2b",
    "BLAKE2b-256 over arrays of keys and token blocks (see _blake2b.c).", -1, methods,
};

PyMODINIT_FUNC
PyInit__blake2b(void)
{
    return PyModule_Create(&module);
}

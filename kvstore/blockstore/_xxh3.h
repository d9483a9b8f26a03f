/* The shard checksum in C, for the direct reader's extensions (_shardsums.c, _recvpieces.c).
 *
 * A shard's checksum (kvstore/ec/shard.py) is xxh3-64 over its 64-byte header from byte 8 on,
 * its fragment and the fragment's zero padding, stored big-endian in the header's first 8
 * bytes. xxh3 comes from the xxhash package's own extension (a dependency of kvstore, already
 * loaded): its streaming functions are looked up there once, at import, so no xxhash header or
 * library is needed at build time and the reader hashes with exactly the code the writer used.
 */
#ifndef KVSTORE_BLOCKSTORE_XXH3_H
#define KVSTORE_BLOCKSTORE_XXH3_H

#include <Python.h>
#include <dlfcn.h>
#include <stdint.h>

#define SHARD_HEADER_BYTES 64
#define SHARD_CHECKED_FROM 8

typedef struct {
    void *(*create_state)(void);
    int (*free_state)(void *);
    int (*reset)(void *);
    int (*update)(void *, const void *, size_t);
    uint64_t (*digest)(const void *);
} xxh3_t;

static const uint8_t XXH3_ZEROS[4096];

/* Fill x from the xxhash extension; -1 with an ImportError naming who asked where it cannot. */
static int
find_xxh3(xxh3_t *x, const char *who)
{
    PyObject *module = PyImport_ImportModule("xxhash._xxhash");
    if (module == NULL)
        return -1;
    PyObject *file = PyObject_GetAttrString(module, "__file__");
    Py_DECREF(module);
    if (file == NULL)
        return -1;
    const char *path = PyUnicode_AsUTF8(file);
    void *library = path == NULL ? NULL : dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    Py_DECREF(file);
    if (library == NULL) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_ImportError, "%s: the xxhash extension is not loaded", who);
        return -1;
    }
    *(void **)&x->create_state = dlsym(library, "XXH3_createState");
    *(void **)&x->free_state = dlsym(library, "XXH3_freeState");
    *(void **)&x->reset = dlsym(library, "XXH3_64bits_reset");
    /* The dispatching update picks the widest vector unit the CPU has at run time (AVX2 or
     * AVX-512 where there is one); the plain one is built for SSE2 only and hashes at about
     * half the speed. Both compute the same digest; older xxhash builds lack the first. */
    *(void **)&x->update = dlsym(library, "XXH3_64bits_update_dispatch");
    if (x->update == NULL)
        *(void **)&x->update = dlsym(library, "XXH3_64bits_update");
    *(void **)&x->digest = dlsym(library, "XXH3_64bits_digest");
    if (!x->create_state || !x->free_state || !x->reset || !x->update || !x->digest) {
        PyErr_Format(PyExc_ImportError, "%s: the xxhash extension exports no xxh3", who);
        return -1;
    }
    return 0;
}

/* Begin a shard's checksum: its header from SHARD_CHECKED_FROM on. */
static void
shard_sum_begin(const xxh3_t *x, void *state, const uint8_t *head)
{
    x->reset(state);
    x->update(state, head + SHARD_CHECKED_FROM, SHARD_HEADER_BYTES - SHARD_CHECKED_FROM);
}

/* End it: pad zero bytes, then whether the digest is the one the header stores. */
static int
shard_sum_holds(const xxh3_t *x, void *state, const uint8_t *head, int64_t pad)
{
    while (pad > 0) {
        size_t step = pad < (int64_t)sizeof(XXH3_ZEROS) ? (size_t)pad : sizeof(XXH3_ZEROS);
        x->update(state, XXH3_ZEROS, step);
        pad -= (int64_t)step;
    }
    uint64_t stored = 0;
    for (int i = 0; i < 8; i++)
        stored = (stored << 8) | head[i];
    return x->digest(state) == stored;
}

#endif

/* A 64-bit hash of each key in C: the splitmix64 chain of placement._key_hash, one pass.
 *
 * placement.py picks a key's meta shard and scores its stripe placement from this hash. In
 * numpy it is ~40 array operations (four splitmix64 rounds, one per key word) whatever the
 * batch: ~30-50 us for the 16 keys a meta shard checks on each call of every put (both of its
 * calls) and lookup, several times the call's own work. placement._key_hash stays the
 * reference and the fallback where the extension is not built; both give the same values.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "_buffers.h"

static inline uint64_t
splitmix64(uint64_t z)
{
    z += 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

static PyObject *
key_hash(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *words_obj, *out_obj;
    Py_ssize_t width;
    unsigned long long seed;
    if (!PyArg_ParseTuple(args, "OnKO", &words_obj, &width, &seed, &out_obj))
        return NULL;
    Py_buffer words, out;
    if (contiguous(words_obj, &words, 0, "words") < 0)
        return NULL;
    if (contiguous(out_obj, &out, 1, "out") < 0) {
        PyBuffer_Release(&words);
        return NULL;
    }
    PyObject *result = NULL;
    const Py_ssize_t n = out.len / 8;
    if (width < 1 || out.len % 8 || words.len != n * width * 8) {
        PyErr_SetString(PyExc_ValueError,
                        "key_hash: (n, width) uint64 words, width >= 1, and n uint64 out expected");
        goto release;
    }
    const uint64_t *w = (const uint64_t *)words.buf;
    uint64_t *o = (uint64_t *)out.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        const uint64_t *key = w + i * width;
        uint64_t mixed = splitmix64(key[0] ^ (uint64_t)seed);
        for (Py_ssize_t c = 1; c < width; c++)
            mixed = splitmix64(mixed ^ key[c]);
        o[i] = mixed;
    }
    result = Py_NewRef(Py_None);
release:
    PyBuffer_Release(&out);
    PyBuffer_Release(&words);
    return result;
}

static PyMethodDef methods[] = {
    {"key_hash", key_hash, METH_VARARGS,
     "key_hash(words, width, seed, out): out[i] = the splitmix64 chain over row i of the (n, "
     "width) uint64 words, seeded (placement._key_hash)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvstore.blockstore._keymix",
    "A 64-bit hash of each key in C (see _keymix.c).", -1, methods,
};

PyMODINIT_FUNC
PyInit__keymix(void)
{
    return PyModule_Create(&module);
}

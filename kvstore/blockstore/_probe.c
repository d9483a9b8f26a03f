/* The block index's hot loop in C: find the rows of many keys in the open-addressing table.
 *
 * Same table, same hash and the same linear probing as BlockIndex._probe (index.py), which
 * stays the reference: a key's home slot is ((k0^k1^k2^k3) * MULTIPLIER) >> (64 - bits); a
 * slot holds a row (>= 0), EMPTY (-1: the chain ends) or TOMBSTONE (-2: keep probing). A
 * 1,000-key lookup is ~20 numpy calls per probe round in Python, and the rounds are as many as
 * the longest chain; here it is one pass, without the GIL.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_buffers.h"

static PyObject *
find_rows(PyObject *self, PyObject *args)
{
    PyObject *table_obj, *column_obj, *keys_obj, *out_obj;
    unsigned long long multiplier;
    int bits;
    if (!PyArg_ParseTuple(args, "OOOOKi", &table_obj, &column_obj, &keys_obj, &out_obj,
                          &multiplier, &bits))
        return NULL;
    Py_buffer table, column, keys, out;
    if (contiguous(table_obj, &table, 0, "table") < 0)
        return NULL;
    if (contiguous(column_obj, &column, 0, "column") < 0)
        goto release_table;
    if (contiguous(keys_obj, &keys, 0, "keys") < 0)
        goto release_column;
    if (contiguous(out_obj, &out, 1, "out") < 0)
        goto release_keys;

    const Py_ssize_t slots = table.len / 4, rows = column.len / 32, n = keys.len / 32;
    if (table.len % 4 || column.len % 32 || keys.len % 32 || out.len != n * 8 ||
        slots < 2 || (slots & (slots - 1)) || bits < 1 || bits > 63 ||
        ((Py_ssize_t)1 << bits) != slots) {
        PyErr_SetString(PyExc_ValueError,
                        "find_rows: table of 2**bits int32 slots, (rows, 4) uint64 column, "
                        "(n, 4) uint64 keys and n int64 out expected");
        PyBuffer_Release(&out);
        goto release_keys;
    }
    const int32_t *t = (const int32_t *)table.buf;
    const uint64_t *c = (const uint64_t *)column.buf;
    const uint64_t *k = (const uint64_t *)keys.buf;
    int64_t *o = (int64_t *)out.buf;
    const uint64_t mask = (uint64_t)slots - 1;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        const uint64_t *key = k + 4 * i;
        uint64_t slot = ((key[0] ^ key[1] ^ key[2] ^ key[3]) * (uint64_t)multiplier) >> (64 - bits);
        int64_t found = -1;
        for (Py_ssize_t probes = 0; probes < slots; probes++) {
            const int32_t occupant = t[slot];
            if (occupant == -1)
                break; /* EMPTY: the chain ends, the key is absent */
            if (occupant >= 0 && occupant < rows &&
                memcmp(c + 4 * (Py_ssize_t)occupant, key, 32) == 0) {
                found = occupant;
                break;
            }
            slot = (slot + 1) & mask; /* a tombstone or another key: keep probing */
        }
        o[i] = found;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&out);
    PyBuffer_Release(&keys);
    PyBuffer_Release(&column);
    PyBuffer_Release(&table);
    Py_RETURN_NONE;

release_keys:
    PyBuffer_Release(&keys);
release_column:
    PyBuffer_Release(&column);
release_table:
    PyBuffer_Release(&table);
    return NULL;
}

static PyMethodDef methods[] = {
    {"find_rows", find_rows, METH_VARARGS,
     "find_rows(table, column, keys, out, multiplier, bits): out[i] = row of keys[i] or -1."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvstore.blockstore._probe",
    "The block index's probe loop in C (see _probe.c).", -1, methods,
};

PyMODINIT_FUNC
PyInit__probe(void)
{
    return PyModule_Create(&module);
}

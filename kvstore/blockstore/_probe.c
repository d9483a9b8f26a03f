/* The block index's hot loop in C: find the rows of many keys in the open-addressing table.
 *
 * Same table, same hash and the same linear probing as BlockIndex._probe (index.py), which
 * stays the reference: a key's home slot is ((k0^k1^k2^k3) * MULTIPLIER) >> (64 - bits); a
 * slot holds a row (>= 0), EMPTY (-1: the chain ends) or TOMBSTONE (-2: keep probing). A
 * 1,000-key lookup is ~20 numpy calls per probe round in Python, and the rounds are as many as
 * the longest chain; here it is one pass, without the GIL.
 *
 * claim_slots is the insert's half (BlockIndex._insert): for each key, its row when the
 * table has it, else the EMPTY slot that ends its chain, claimed at once with the code -3 - i
 * so that a later key of the same batch probes past it, or, being the same key, is told which
 * earlier position to share (first[i]). The caller then writes rows into the claimed slots.
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

static PyObject *
claim_slots(PyObject *self, PyObject *args)
{
    PyObject *table_obj, *column_obj, *keys_obj, *rows_obj, *slots_obj, *first_obj;
    unsigned long long multiplier;
    int bits;
    if (!PyArg_ParseTuple(args, "OOOOOOKi", &table_obj, &column_obj, &keys_obj, &rows_obj,
                          &slots_obj, &first_obj, &multiplier, &bits))
        return NULL;
    Py_buffer b[6];
    PyObject *objects[6] = {table_obj, column_obj, keys_obj, rows_obj, slots_obj, first_obj};
    const char *names[6] = {"table", "column", "keys", "rows", "slots", "first"};
    const int writable[6] = {1, 0, 0, 1, 1, 1};
    int taken = 0;
    PyObject *result = NULL;
    for (; taken < 6; taken++)
        if (contiguous(objects[taken], &b[taken], writable[taken], names[taken]) < 0)
            goto release;
    const Py_ssize_t slots = b[0].len / 4, rows = b[1].len / 32, n = b[2].len / 32;
    if (b[0].len % 4 || b[1].len % 32 || b[2].len % 32 || b[3].len != n * 8 ||
        b[4].len != n * 8 || b[5].len != n * 8 || slots < 2 || (slots & (slots - 1)) ||
        bits < 1 || bits > 63 || ((Py_ssize_t)1 << bits) != slots || n > INT32_MAX - 3) {
        PyErr_SetString(PyExc_ValueError,
                        "claim_slots: table of 2**bits int32 slots, (rows, 4) uint64 column, "
                        "(n, 4) uint64 keys and three n-long int64 outs expected");
        goto release;
    }
    int32_t *t = (int32_t *)b[0].buf;
    const uint64_t *c = (const uint64_t *)b[1].buf;
    const uint64_t *k = (const uint64_t *)b[2].buf;
    int64_t *row_out = (int64_t *)b[3].buf, *slot_out = (int64_t *)b[4].buf;
    int64_t *first = (int64_t *)b[5].buf;
    const uint64_t mask = (uint64_t)slots - 1;
    Py_ssize_t full = -1;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n && full < 0; i++) {
        const uint64_t *key = k + 4 * i;
        uint64_t slot = ((key[0] ^ key[1] ^ key[2] ^ key[3]) * (uint64_t)multiplier) >> (64 - bits);
        Py_ssize_t probes = 0;
        for (; probes < slots; probes++, slot = (slot + 1) & mask) {
            const int32_t occupant = t[slot];
            if (occupant == -1) { /* EMPTY: not in the table; this slot is the key's */
                t[slot] = (int32_t)(-3 - i);
                row_out[i] = -1;
                first[i] = i;
                break;
            }
            if (occupant >= 0 && occupant < rows &&
                memcmp(c + 4 * (Py_ssize_t)occupant, key, 32) == 0) {
                row_out[i] = occupant;
                first[i] = -1;
                break;
            }
            if (occupant <= -3 && memcmp(k + 4 * (Py_ssize_t)(-3 - occupant), key, 32) == 0) {
                row_out[i] = -1; /* claimed by an earlier position of this batch */
                first[i] = -3 - occupant;
                break;
            }
            /* a tombstone or another key: keep probing */
        }
        slot_out[i] = (int64_t)slot;
        if (probes == slots)
            full = i;
    }
    Py_END_ALLOW_THREADS
    if (full >= 0) {
        PyErr_SetString(PyExc_RuntimeError, "claim_slots: the table has no empty slot");
        goto release;
    }
    result = Py_None;
    Py_INCREF(result);
release:
    while (taken-- > 0)
        PyBuffer_Release(&b[taken]);
    return result;
}

static PyMethodDef methods[] = {
    {"find_rows", find_rows, METH_VARARGS,
     "find_rows(table, column, keys, out, multiplier, bits): out[i] = row of keys[i] or -1."},
    {"claim_slots", claim_slots, METH_VARARGS,
     "claim_slots(table, column, keys, rows, slots, first, multiplier, bits): see _probe.c."},
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

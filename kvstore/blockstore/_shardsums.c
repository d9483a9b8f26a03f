/* Shard checksums in C: every landed shard of a direct read checked in one call, and the
 * checksums of a batch of equal-length shards (a put's, on the writer and on each node) in one.
 *
 * A shard's checksum (kvstore/ec/shard.py) is xxh3-64 over its header from byte 8 on, its
 * fragment and the fragment's zero padding, stored big-endian in the header's first 8 bytes.
 * The direct reader (direct.py) receives headers into a table and fragments straight into the
 * caller's buffer, so each shard is hashed from two or more places. Hashing them one Python
 * call at a time cost ~1 ms of a 64-block read of 111 KiB blocks (640 shards; the bytes
 * themselves ~0.3 ms); here it is one pass, without the GIL. direct.py's Python loop stays the
 * reference and the fallback when the extension is not built or cannot find xxh3.
 *
 * xxh3 is the xxhash package's own (_xxh3.h); where its extension does not export it, importing
 * this module fails and the Python loop serves. take_replies (_recvpieces.c) checks the shards
 * of a read's usual replies as they land instead; this call checks the others.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_buffers.h"
#include "_xxh3.h"

static xxh3_t xxh3;

#define HEADER_BYTES SHARD_HEADER_BYTES

/* The checksum of one shard: header tail, then its pieces, then pad zero bytes. */
static int
shard_ok(void *state, const uint8_t *head, const uint8_t *data, const int64_t *at,
         const int64_t *len, Py_ssize_t pieces, int64_t pad)
{
    shard_sum_begin(&xxh3, state, head);
    for (Py_ssize_t p = 0; p < pieces; p++)
        if (len[p])
            xxh3.update(state, data + at[p], (size_t)len[p]);
    return shard_sum_holds(&xxh3, state, head, pad);
}

static PyObject *
check_sums(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *objects[7];
    if (!PyArg_ParseTuple(args, "OOOOOOO", &objects[0], &objects[1], &objects[2], &objects[3],
                          &objects[4], &objects[5], &objects[6]))
        return NULL;
    static const char *names[7] = {"heads", "head_at", "data",  "piece_at",
                                   "piece_len", "pads", "ok"};
    Py_buffer views[7];
    int taken = 0;
    PyObject *result = NULL;
    for (; taken < 7; taken++)
        if (contiguous(objects[taken], &views[taken], taken == 6, names[taken]) < 0)
            goto release;
    Py_buffer *heads = &views[0], *head_at = &views[1], *data = &views[2], *piece_at = &views[3],
              *piece_len = &views[4], *pads = &views[5], *ok = &views[6];
    const Py_ssize_t shards = ok->len;
    if (head_at->len != shards * 8 || pads->len != shards * 8 || piece_at->len != piece_len->len ||
        piece_at->len % 8 || (shards && (piece_at->len / 8) % shards) ||
        (!shards && piece_at->len)) {
        PyErr_SetString(PyExc_ValueError,
                        "check_sums: n int64 head_at and pads, (n, pieces) int64 piece_at and "
                        "piece_len, n uint8 ok expected");
        goto release;
    }
    const Py_ssize_t per_shard = shards ? piece_at->len / 8 / shards : 0;
    const int64_t *heads_at = head_at->buf, *ats = piece_at->buf, *lens = piece_len->buf,
                  *pad = pads->buf;
    /* Every place named must lie inside its buffer (an empty piece is never read: its offset
     * does not count): a wrong table is an error, never a read outside it. */
    for (Py_ssize_t s = 0; s < shards; s++) {
        int bad = heads_at[s] < 0 || heads_at[s] > heads->len - HEADER_BYTES || pad[s] < 0;
        for (Py_ssize_t p = s * per_shard; p < (s + 1) * per_shard && !bad; p++)
            bad = lens[p] < 0 ||
                  (lens[p] && (ats[p] < 0 || ats[p] > data->len || lens[p] > data->len - ats[p]));
        if (bad) {
            PyErr_Format(PyExc_ValueError, "check_sums: shard %zd names bytes outside its buffers",
                         s);
            goto release;
        }
    }
    void *state = xxh3.create_state();
    if (state == NULL) {
        PyErr_NoMemory();
        goto release;
    }
    const uint8_t *head_bytes = heads->buf, *data_bytes = data->buf;
    uint8_t *out = ok->buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t s = 0; s < shards; s++)
        out[s] = (uint8_t)shard_ok(state, head_bytes + heads_at[s], data_bytes,
                                   ats + s * per_shard, lens + s * per_shard, per_shard, pad[s]);
    Py_END_ALLOW_THREADS
    xxh3.free_state(state);
    result = Py_None;
    Py_INCREF(result);
release:
    while (taken-- > 0)
        PyBuffer_Release(&views[taken]);
    return result;
}

/* Each row of a batch of equal-length shards (Codec.encode_rows: a writer; parse_rows: a node
 * taking a put) hashed as its checksum is: the row from byte 8 on. Returns the digests
 * big-endian, 8 bytes a row, end to end. One call a batch instead of a Python call a shard (768
 * for a 64-block put on the writer, 64 on each node). */
static PyObject *
row_sums(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *object;
    Py_ssize_t row_len;
    if (!PyArg_ParseTuple(args, "On", &object, &row_len))
        return NULL;
    Py_buffer view;
    if (contiguous(object, &view, 0, "rows") < 0)
        return NULL;
    if (row_len < HEADER_BYTES || view.len % row_len) {
        PyErr_Format(PyExc_ValueError, "row_sums: rows of %zd bytes (at least %d) expected",
                     row_len, HEADER_BYTES);
        PyBuffer_Release(&view);
        return NULL;
    }
    const Py_ssize_t rows = view.len / row_len;
    PyObject *out = PyBytes_FromStringAndSize(NULL, rows * 8);
    void *state = out == NULL ? NULL : xxh3.create_state();
    if (state == NULL) {
        Py_XDECREF(out);
        PyBuffer_Release(&view);
        return out == NULL ? NULL : PyErr_NoMemory();
    }
    const uint8_t *row = view.buf;
    uint8_t *digests = (uint8_t *)PyBytes_AS_STRING(out);
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t r = 0; r < rows; r++, row += row_len) {
        xxh3.reset(state);
        xxh3.update(state, row + SHARD_CHECKED_FROM, (size_t)(row_len - SHARD_CHECKED_FROM));
        uint64_t digest = xxh3.digest(state);
        for (int i = 7; i >= 0; i--, digest >>= 8)
            digests[r * 8 + i] = (uint8_t)digest;
    }
    Py_END_ALLOW_THREADS
    xxh3.free_state(state);
    PyBuffer_Release(&view);
    return out;
}

static PyMethodDef methods[] = {
    {"check_sums", check_sums, METH_VARARGS,
     "check_sums(heads, head_at, data, piece_at, piece_len, pads, ok): ok[s] = 1 where shard "
     "s's checksum (the first 8 bytes of the header at heads[head_at[s]:], big-endian) is the "
     "xxh3-64 of that header from byte 8 on, the data pieces (piece_at[s, p], piece_len[s, p]) "
     "in order and pads[s] zero bytes; else 0."},
    {"row_sums", row_sums, METH_VARARGS,
     "row_sums(rows, row_len): each row's shard checksum (xxh3-64 of the row from byte 8 on), "
     "big-endian, 8 bytes a row, as one bytes object."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvstore.blockstore._shardsums",
    "Shard checksums in C, checked and written (see _shardsums.c).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__shardsums(void)
{
    if (find_xxh3(&xxh3, "_shardsums") < 0)
        return NULL;
    return PyModule_Create(&module);
}

/* Shard checksums in C: every landed shard of a direct read checked in one call, the
 * checksums of a batch of equal-length shards (a put's, on the writer; a batch of segment
 * record headers likewise) in one, and a put's batch checked whole on a node (check_rows: its
 * headers and checksums) in one.
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
    if (take_all(objects, views, 7, 6, names) < 0)
        return NULL;
    PyObject *result = NULL;
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
    result = Py_NewRef(Py_None);
release:
    release_all(views, 7);
    return result;
}

/* Each row of a batch of equal-length rows hashed over [start, stop): a shard's checksum by
 * default (the row from byte 8 on: Codec.encode_rows, a writer; parse_rows' stand-in), or a
 * segment record header's (bytes 0-88 of 96: segments.py). Returns the digests big-endian,
 * 8 bytes a row, end to end. One call a batch instead of a Python call a row (768 for a
 * 64-block put on the writer, 64 record headers on each node). */
static PyObject *
row_sums(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *object;
    Py_ssize_t row_len, start = SHARD_CHECKED_FROM, stop = -1;
    if (!PyArg_ParseTuple(args, "On|nn", &object, &row_len, &start, &stop))
        return NULL;
    if (stop < 0)
        stop = row_len;
    Py_buffer view;
    if (contiguous(object, &view, 0, "rows") < 0)
        return NULL;
    if (row_len < 1 || view.len % row_len || start < 0 || start > stop || stop > row_len) {
        PyErr_Format(PyExc_ValueError,
                     "row_sums: rows of %zd bytes hashed over [%zd, %zd) do not fit %zd bytes",
                     row_len, start, stop, view.len);
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
        xxh3.update(state, row + start, (size_t)(stop - start));
        uint64_t digest = xxh3.digest(state);
        for (int i = 7; i >= 0; i--, digest >>= 8)
            digests[r * 8 + i] = (uint8_t)digest;
    }
    Py_END_ALLOW_THREADS
    xxh3.free_state(state);
    PyBuffer_Release(&view);
    return out;
}

/* The header fields a node takes a put's shard by (kvstore/ec/shard.py, LAYOUT). */
#define MAGIC_AT 8
#define INDEX_AT 12
#define VERSION_AT 13
#define K_AT 14
#define M_AT 15
#define PAYLOAD_LEN_AT 16
#define PAYLOAD_HASH_AT 24
#define KEY_AT 32
#define KEY_BYTES 32
#define SHARD_VERSION 1
#define MAX_SHARDS 32
#define FRAGMENT_ALIGN 64

static uint64_t
read_le64(const uint8_t *at)
{
    uint64_t value = 0;
    for (int i = 7; i >= 0; i--)
        value = (value << 8) | at[i];
    return value;
}

/* Whether a row of row_len bytes is a whole shard of the key at key: parse_shard's checks
 * (magic, version, geometry, length for its payload, checksum) and the key's. */
static int
row_ok(void *state, const uint8_t *row, Py_ssize_t row_len, const uint8_t *key)
{
    const unsigned k = row[K_AT], m = row[M_AT];
    if (memcmp(row + MAGIC_AT, "KVEC", 4) != 0 || row[VERSION_AT] != SHARD_VERSION || k < 1 ||
        m < 1 || k + m > MAX_SHARDS || row[INDEX_AT] >= k + m)
        return 0;
    /* fragment_length: ceil(payload / k), rounded up to FRAGMENT_ALIGN, at least that. A
     * per-shard length past the row is refused before the rounding could wrap. */
    const uint64_t per_shard = read_le64(row + PAYLOAD_LEN_AT) / k +
                               (read_le64(row + PAYLOAD_LEN_AT) % k != 0);
    if (per_shard > (uint64_t)row_len)
        return 0;
    uint64_t fragment = (per_shard + FRAGMENT_ALIGN - 1) / FRAGMENT_ALIGN * FRAGMENT_ALIGN;
    if (fragment < FRAGMENT_ALIGN)
        fragment = FRAGMENT_ALIGN;
    if (fragment != (uint64_t)(row_len - HEADER_BYTES) || memcmp(row + KEY_AT, key, KEY_BYTES) != 0)
        return 0;
    shard_sum_begin(&xxh3, state, row);
    xxh3.update(state, row + HEADER_BYTES, (size_t)(row_len - HEADER_BYTES));
    return shard_sum_holds(&xxh3, state, row, 0);
}

/* A put's batch on a node (parse_rows): each row of rows checked as a whole shard of the key
 * in the same row of keys, and its stripe index, payload length and payload hash (the hash's
 * 8 bytes read little-endian, as the node's index keeps it) read out. One pass without the
 * GIL instead of ~25 array passes, most of them over a few bytes a row. */
static PyObject *
check_rows(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *objects[6];
    Py_ssize_t row_len;
    if (!PyArg_ParseTuple(args, "OnOOOOO", &objects[0], &row_len, &objects[1], &objects[2],
                          &objects[3], &objects[4], &objects[5]))
        return NULL;
    static const char *names[6] = {"rows", "keys", "ok", "index", "payload_len", "payload_hash"};
    Py_buffer views[6];
    if (take_all(objects, views, 6, 2, names) < 0)
        return NULL;
    PyObject *result = NULL;
    const Py_ssize_t n = views[2].len;
    if (row_len < HEADER_BYTES || views[0].len != n * row_len || views[1].len != n * KEY_BYTES ||
        views[3].len != n * 8 || views[4].len != n * 8 || views[5].len != n * 8) {
        PyErr_Format(PyExc_ValueError,
                     "check_rows: n rows of %zd bytes (at least %d), (n, %d) uint8 keys, n uint8 "
                     "ok, n int64 index, payload_len and payload_hash expected",
                     row_len, HEADER_BYTES, KEY_BYTES);
        goto release;
    }
    void *state = xxh3.create_state();
    if (state == NULL) {
        PyErr_NoMemory();
        goto release;
    }
    const uint8_t *rows = views[0].buf, *keys = views[1].buf;
    uint8_t *ok = views[2].buf;
    int64_t *index = views[3].buf;
    uint64_t *payload_len = views[4].buf, *payload_hash = views[5].buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t r = 0; r < n; r++) {
        const uint8_t *row = rows + r * row_len;
        ok[r] = (uint8_t)row_ok(state, row, row_len, keys + r * KEY_BYTES);
        index[r] = row[INDEX_AT];
        payload_len[r] = read_le64(row + PAYLOAD_LEN_AT);
        payload_hash[r] = read_le64(row + PAYLOAD_HASH_AT);
    }
    Py_END_ALLOW_THREADS
    xxh3.free_state(state);
    result = Py_NewRef(Py_None);
release:
    release_all(views, 6);
    return result;
}

static PyMethodDef methods[] = {
    {"check_sums", check_sums, METH_VARARGS,
     "check_sums(heads, head_at, data, piece_at, piece_len, pads, ok): ok[s] = 1 where shard "
     "s's checksum (the first 8 bytes of the header at heads[head_at[s]:], big-endian) is the "
     "xxh3-64 of that header from byte 8 on, the data pieces (piece_at[s, p], piece_len[s, p]) "
     "in order and pads[s] zero bytes; else 0."},
    {"row_sums", row_sums, METH_VARARGS,
     "row_sums(rows, row_len, start=8, stop=row_len): the xxh3-64 of each row's bytes [start, "
     "stop) (by default its shard checksum), big-endian, 8 bytes a row, as one bytes object."},
    {"check_rows", check_rows, METH_VARARGS,
     "check_rows(rows, row_len, keys, ok, index, payload_len, payload_hash): ok[r] = 1 where "
     "row r of rows is a whole shard (magic, version, geometry, length, checksum) of the key in "
     "row r of keys, else 0; each row's stripe index, payload length and payload hash (its 8 "
     "bytes little-endian) written out."},
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

/* The direct reader's scatter receive in C: recvmsg into many pieces of a few buffers.
 *
 * A node's reply to an engine read lands in pieces: each shard's record header and shard
 * header into a table slot, its fragment at its place in the block (or cut at layer
 * boundaries), padding into scratch. A 64-block read of 111 KiB blocks is ~1,900 pieces; made
 * as a Python memoryview each for socket.recvmsg_into, they cost more CPU than the bytes' own
 * copy. Here the pieces are three int64 arrays (buffer number, offset, length) over a tuple of
 * buffers, and the receive's iovec is built from them in C, without the GIL for the receive;
 * one call takes all the socket holds (a receive a few hundred KiB here) and says where the
 * next byte goes, so the reader's Python runs once per wake-up, not per receive.
 * readlinks.Scatter's memoryview loop stays the reference and the fallback (TLS, a socket with
 * a timeout, the extension not built).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include "_buffers.h"

#define MAX_BUFFERS 8
#define MAX_IOV 1024 /* IOV_MAX on Linux */

/* The iovec of the pieces from (first, skip) on, at most room bytes and MAX_IOV pieces, into
 * iov; its byte count into *asked. -1 with a ValueError where a piece it would use lies outside
 * its buffer: the caller then receives nothing. */
static int
build_iov(struct iovec *iov, Py_buffer *targets, Py_ssize_t count, const int64_t *which,
          const int64_t *offsets, const int64_t *lengths, Py_ssize_t pieces, Py_ssize_t first,
          Py_ssize_t skip, Py_ssize_t room, size_t *asked)
{
    int used = 0;
    *asked = 0;
    /* Only the pieces this receive may fill are checked (and used); an empty piece takes no
     * byte, so where it points does not count. */
    for (Py_ssize_t p = first; p < pieces && used < MAX_IOV && room > 0; p++) {
        int64_t b = which[p], at = offsets[p], len = lengths[p];
        if (len == 0 && p != first)
            continue;
        if (b < 0 || b >= count || at < 0 || len < 0 || at > targets[b].len ||
            len > targets[b].len - at || (p == first && skip >= len)) {
            PyErr_Format(PyExc_ValueError, "recv_pieces: piece %zd names bytes outside its buffer",
                         p);
            return -1;
        }
        int64_t from = p == first ? skip : 0;
        int64_t take = len - from < room ? len - from : room;
        iov[used].iov_base = (char *)targets[b].buf + at + from;
        iov[used].iov_len = (size_t)take;
        used++;
        room -= take;
        *asked += (size_t)take;
    }
    return used;
}

static PyObject *
recv_pieces(PyObject *self, PyObject *args)
{
    (void)self;
    int fd;
    PyObject *buffers, *arrays[3];
    Py_ssize_t first, skip, most;
    if (!PyArg_ParseTuple(args, "iO!OOOnnn", &fd, &PyTuple_Type, &buffers, &arrays[0], &arrays[1],
                          &arrays[2], &first, &skip, &most))
        return NULL;
    Py_ssize_t count = PyTuple_GET_SIZE(buffers);
    if (count < 1 || count > MAX_BUFFERS) {
        PyErr_Format(PyExc_ValueError, "recv_pieces: 1 to %d buffers", MAX_BUFFERS);
        return NULL;
    }
    static const char *names[3] = {"which", "offsets", "lengths"};
    Py_buffer targets[MAX_BUFFERS], tables[3];
    int held = 0, tabled = 0;
    PyObject *result = NULL;
    for (; held < count; held++)
        if (contiguous(PyTuple_GET_ITEM(buffers, held), &targets[held], 1, "buffers") < 0)
            goto release;
    for (; tabled < 3; tabled++)
        if (contiguous(arrays[tabled], &tables[tabled], 0, names[tabled]) < 0)
            goto release;
    Py_ssize_t pieces = tables[0].len / 8;
    if (tables[0].len % 8 || tables[1].len != tables[0].len || tables[2].len != tables[0].len) {
        PyErr_SetString(PyExc_ValueError, "recv_pieces: which, offsets, lengths: n int64 each");
        goto release;
    }
    if (first < 0 || first >= pieces || skip < 0 || most == 0 || most < -1) {
        PyErr_SetString(PyExc_ValueError, "recv_pieces: nothing left to receive");
        goto release;
    }
    const int64_t *which = tables[0].buf, *offsets = tables[1].buf, *lengths = tables[2].buf;
    struct iovec iov[MAX_IOV];
    Py_ssize_t room = most < 0 ? PY_SSIZE_T_MAX : most, total = 0;
    int drained = 0;
    /* Receive until the socket holds no more (a short read, or EAGAIN), the pieces are full or
     * room is spent; a failure after some bytes landed ends the loop and is met again by the
     * next call, which then has received nothing. */
    while (room > 0 && first < pieces) {
        size_t asked;
        int used = build_iov(iov, targets, count, which, offsets, lengths, pieces, first, skip,
                             room, &asked);
        if (used < 0) {
            if (total == 0)
                goto release;
            PyErr_Clear();
            break;
        }
        struct msghdr message = {0};
        message.msg_iov = iov;
        message.msg_iovlen = (size_t)used;
        ssize_t got;
        Py_BEGIN_ALLOW_THREADS
        got = recvmsg(fd, &message, 0);
        Py_END_ALLOW_THREADS
        if (got < 0) {
            if (errno == EINTR) {
                if (PyErr_CheckSignals() < 0)
                    goto release;
                continue;
            }
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                drained = 1;
                break;
            }
            if (total > 0)
                break;
            PyErr_SetFromErrno(PyExc_OSError);
            goto release;
        }
        if (got == 0) /* the end of the stream: met by this call or the next */
            break;
        total += got;
        room -= got;
        /* On past the pieces filled (and the empty ones after them). */
        Py_ssize_t left = got;
        while (first < pieces && left >= lengths[first] - skip) {
            left -= lengths[first] - skip;
            first++;
            skip = 0;
        }
        skip += left;
        if ((size_t)got < asked) { /* a short read: the socket held no more */
            drained = 1;
            break;
        }
    }
    result = Py_BuildValue("(nnnN)", total, first, skip, PyBool_FromLong(drained));
release:
    while (tabled-- > 0)
        PyBuffer_Release(&tables[tabled]);
    while (held-- > 0)
        PyBuffer_Release(&targets[held]);
    return result;
}

static PyMethodDef methods[] = {
    {"recv_pieces", recv_pieces, METH_VARARGS,
     "recv_pieces(fd, buffers, which, offsets, lengths, first, skip, most) -> (received, first, "
     "skip, drained): recvmsg on the non-blocking fd into pieces first.. (piece p: "
     "buffers[which[p]][offsets[p]:][:lengths[p]], its first skip bytes already filled) until "
     "the socket holds no more (drained), the pieces are full or most bytes (-1: no limit) are "
     "in; the piece to fill next and its bytes filled. (0, .., 0) at the end of the stream; "
     "OSError as recvmsg fails before any byte."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvstore.blockstore._recvpieces", "The direct reader's scatter receive in C.", -1, methods,
};

PyMODINIT_FUNC
PyInit__recvpieces(void)
{
    return PyModule_Create(&module);
}

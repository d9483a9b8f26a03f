/* A storage node's engine read reply, sent straight from its segment files in one C call.
 *
 * The reply (kvstore/blockstore/readproto.py) is one frame: a 4-byte big-endian length, the
 * reply's head, status table and lengths (built in Python: readserver._parts), then each served
 * shard as its whole record (the record header is the reply's prefix, skipped by the reader).
 * Records that lie end to end in one segment file (a put batch's) go in one sendfile: page cache
 * to socket, never through this process. Working out those runs and sending them took ~30 us of
 * Python a request, on a node that serves a dozen engines' reads at once; here it is one call,
 * the GIL released while it sends.
 *
 * The socket is blocking: SO_SNDTIMEO bounds each wait (readserver sets it), the deadline the
 * whole. Without this extension a node sends its replies from one buffer (as under TLS).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdint.h>
#include <sys/sendfile.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>

#include "_buffers.h"

#define MAX_PARTS 8

static double
monotonic(void)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)now.tv_sec + (double)now.tv_nsec * 1e-9;
}

/* Why a send stopped: 0 sent, else errno, or one of these. */
enum { LATE = -1, SHORT_FILE = -2 };

/* Send the iovecs whole (MSG_MORE: they wait for the records that follow). */
static int
send_head(int fd, struct iovec *parts, int count, double deadline)
{
    struct msghdr message = {0};
    while (count) {
        if (monotonic() > deadline)
            return LATE;
        message.msg_iov = parts;
        message.msg_iovlen = (size_t)count;
        ssize_t sent = sendmsg(fd, &message, MSG_MORE | MSG_NOSIGNAL);
        if (sent < 0) {
            if (errno == EINTR)
                continue;
            return errno;
        }
        while (count && (size_t)sent >= parts->iov_len) {
            sent -= (ssize_t)parts->iov_len;
            parts++;
            count--;
        }
        if (count) {
            parts->iov_base = (char *)parts->iov_base + sent;
            parts->iov_len -= (size_t)sent;
        }
    }
    return 0;
}

static int
send_run(int out, int in, int64_t offset, int64_t length, double deadline)
{
    off_t at = (off_t)offset;
    while (length > 0) {
        if (monotonic() > deadline)
            return LATE;
        ssize_t sent = sendfile(out, in, &at, (size_t)length);
        if (sent < 0) {
            if (errno == EINTR)
                continue;
            return errno;
        }
        if (sent == 0)
            return SHORT_FILE;
        length -= sent;
    }
    return 0;
}

/* send_records(fd, parts, places, seqs, fds, record_bytes, deadline) -> sends
 *
 * parts: the reply's buffers before its records; places: int64 (n, 3), per served shard in
 * order its segment, the offset of its bytes and their length (its record header lies the
 * record_bytes before them); seqs and fds: int64, the descriptor to read each segment from. */
static PyObject *
send_records(PyObject *self, PyObject *args)
{
    (void)self;
    int fd;
    PyObject *parts_object, *objects[3];
    long long record_bytes;
    double deadline;
    if (!PyArg_ParseTuple(args, "iO!OOOLd", &fd, &PyTuple_Type, &parts_object, &objects[0],
                          &objects[1], &objects[2], &record_bytes, &deadline))
        return NULL;
    Py_ssize_t part_count = PyTuple_GET_SIZE(parts_object);
    if (part_count > MAX_PARTS) {
        PyErr_Format(PyExc_ValueError, "parts: at most %d buffers", MAX_PARTS);
        return NULL;
    }
    static const char *names[3] = {"places", "seqs", "fds"};
    Py_buffer views[3], parts[MAX_PARTS];
    int taken = 0, parts_taken = 0;
    PyObject *result = NULL;
    for (; taken < 3; taken++)
        if (contiguous(objects[taken], &views[taken], 0, names[taken]) < 0)
            goto release;
    for (; parts_taken < part_count; parts_taken++)
        if (contiguous(PyTuple_GET_ITEM(parts_object, parts_taken), &parts[parts_taken], 0,
                       "parts") < 0)
            goto release;
    if (views[0].len % 24 || views[1].len % 8 || views[1].len != views[2].len) {
        PyErr_SetString(PyExc_ValueError, "places: (n, 3) int64; seqs and fds: one each");
        goto release;
    }
    const int64_t *places = views[0].buf, *seqs = views[1].buf, *fds = views[2].buf;
    const Py_ssize_t shards = views[0].len / 24, segments = views[1].len / 8;

    /* The runs: a run ends where the next record lies in another segment or not right after. */
    int64_t *runs = PyMem_Malloc(sizeof(int64_t) * 3 * (size_t)(shards ? shards : 1));
    if (!runs) {
        PyErr_NoMemory();
        goto release;
    }
    Py_ssize_t run_count = 0;
    uint64_t total = 0;
    for (Py_ssize_t p = 0; p < part_count; p++)
        total += (uint64_t)parts[p].len;
    for (Py_ssize_t s = 0; s < shards; s++) {
        int64_t seq = places[3 * s], start = places[3 * s + 1] - record_bytes;
        int64_t end = places[3 * s + 1] + places[3 * s + 2];
        if (places[3 * s + 2] < 0 || start < 0) {
            PyErr_SetString(PyExc_ValueError, "places: a record before its segment's start");
            goto free_runs;
        }
        total += (uint64_t)(end - start);
        int64_t *last = run_count ? &runs[3 * (run_count - 1)] : NULL;
        if (last && seqs[last[0]] == seq && last[1] + last[2] == start) {
            last[2] += end - start;
            continue;
        }
        Py_ssize_t found = 0;
        while (found < segments && seqs[found] != seq)
            found++;
        if (found == segments) {
            PyErr_Format(PyExc_ValueError, "places: segment %lld has no descriptor",
                         (long long)seq);
            goto free_runs;
        }
        runs[3 * run_count] = found;
        runs[3 * run_count + 1] = start;
        runs[3 * run_count + 2] = end - start;
        run_count++;
    }
    if (total > UINT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "the reply is larger than a frame holds");
        goto free_runs;
    }
    uint8_t length[4] = {(uint8_t)(total >> 24), (uint8_t)(total >> 16), (uint8_t)(total >> 8),
                         (uint8_t)total};
    struct iovec head[MAX_PARTS + 1];
    head[0].iov_base = length;
    head[0].iov_len = 4;
    for (Py_ssize_t p = 0; p < part_count; p++) {
        head[p + 1].iov_base = parts[p].buf;
        head[p + 1].iov_len = (size_t)parts[p].len;
    }
    int failed;
    Py_BEGIN_ALLOW_THREADS
    failed = send_head(fd, head, (int)part_count + 1, deadline);
    for (Py_ssize_t r = 0; !failed && r < run_count; r++)
        failed = send_run(fd, (int)fds[runs[3 * r]], runs[3 * r + 1], runs[3 * r + 2], deadline);
    Py_END_ALLOW_THREADS
    if (failed == LATE || failed == EAGAIN)
        PyErr_SetString(PyExc_TimeoutError, "engine reads: the peer took too long");
    else if (failed == SHORT_FILE)
        PyErr_SetString(PyExc_EOFError,
                        "engine reads: a segment file is shorter than its index says");
    else if (failed) {
        errno = failed;
        PyErr_SetFromErrno(PyExc_OSError);
    } else
        result = PyLong_FromSsize_t(run_count);
free_runs:
    PyMem_Free(runs);
release:
    for (int p = 0; p < parts_taken; p++)
        PyBuffer_Release(&parts[p]);
    for (int v = 0; v < taken; v++)
        PyBuffer_Release(&views[v]);
    return result;
}

static PyMethodDef methods[] = {
    {"send_records", send_records, METH_VARARGS,
     "Send a reply's parts, then its records from the segment files (runs end to end in one "
     "sendfile); the number of runs sent."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_sendrecords", NULL, -1, methods};

PyMODINIT_FUNC
PyInit__sendrecords(void)
{
    return PyModule_Create(&module);
}

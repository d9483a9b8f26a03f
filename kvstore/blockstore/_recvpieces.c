/* The direct reader's receive in C: recvmsg into many pieces of a few buffers, and the
 * usual replies of every node taken in one call.
 *
 * A node's reply to an engine read lands in pieces: each shard's record header and shard
 * header into a table slot, its fragment at its place in the block (or cut at layer
 * boundaries), padding into scratch. A 64-block read of 111 KiB blocks is ~1,900 pieces; made
 * as a Python memoryview each for socket.recvmsg_into, they cost more CPU than the bytes' own
 * copy. Here the pieces are three int64 arrays (buffer number, offset, length) over a tuple of
 * buffers, and the receive's iovec is built from them in C.
 *
 * recv_pieces: one socket, one wake-up; it takes all the socket holds (a receive a few hundred
 * KiB here) and says where the next byte goes. readlinks.Scatter's memoryview loop stays the
 * reference and the fallback (TLS, a socket with a timeout, the extension not built).
 *
 * take_replies: every node's reply at once, when each is the one the reader expects (every
 * shard asked served whole, so where each byte goes is known before the request leaves). One
 * poll of all the sockets, each reply's head checked as soon as it is in and its status and
 * length table compared with the expected one, then its shard bytes received into their
 * pieces, all without the GIL: the reader's Python runs once a read, not once a reply and a
 * wake-up. Each shard is checked by its checksum as soon as it is whole (_xxh3.h), while its
 * bytes are still in the cache: hashing a 64-block read of 111 KiB blocks took ~0.4 ms so
 * against ~0.6 at the end of the read (perf samples of the reader). A reply that is not the expected one (a refusal, a shard missing, another length)
 * stops there with its head in, and readlinks' Python takes it on from its table; a failure,
 * the end of the stream or the deadline stops a reply where it stood.
 *
 * Once a reply's head is the expected one, its socket wakes the poll only when WAKE_BYTES of
 * it (or all that is left, if less) are in (SO_RCVLOWAT): otherwise the reader woke for every
 * few tens of KiB a node's sends delivered, ~4 polls and receives a reply, each wake-up a
 * context switch. Measured on a deployed tier (64 x 111 KiB reads, 730 KB from each node),
 * the reader's CPU per GB fell 5-10 %. The mark is set only on a reply whose length is known
 * (a short refusal would never reach it and wait out the deadline) and put back to 1 before
 * the call returns, for the Python paths that read the socket next. The kernel still wakes
 * the poll at the end of the stream, on an error, or when the receive window runs short.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <math.h>
#include <poll.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>

#include "_buffers.h"
#include "_xxh3.h"

#define MAX_BUFFERS 8
#define MAX_IOV 1024 /* IOV_MAX on Linux */
/* A reply's socket wakes the poll once this many of its bytes are in (see the top). */
#define WAKE_BYTES (256 * 1024)

/* The iovec of the pieces from (first, skip) on, at most room bytes and MAX_IOV pieces, into
 * iov; its byte count into *asked. -1 where a piece it would use lies outside its buffer (its
 * number into *bad): the caller then receives nothing. Needs no GIL. */
static int
build_iov(struct iovec *iov, Py_buffer *targets, Py_ssize_t count, const int64_t *which,
          const int64_t *offsets, const int64_t *lengths, Py_ssize_t pieces, Py_ssize_t first,
          Py_ssize_t skip, Py_ssize_t room, size_t *asked, Py_ssize_t *bad)
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
            *bad = p;
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
        Py_ssize_t bad;
        int used = build_iov(iov, targets, count, which, offsets, lengths, pieces, first, skip,
                             room, &asked, &bad);
        if (used < 0) {
            if (total == 0) {
                PyErr_Format(PyExc_ValueError,
                             "recv_pieces: piece %zd names bytes outside its buffer", bad);
                goto release;
            }
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

/* --- take_replies --------------------------------------------------------------------- */

/* A reply's head (readproto): the frame's length (4 bytes, big-endian), then REPLY: magic,
 * refusal, a reserved byte, the prefix (u16), the count (u32), the data bytes (u64), little-
 * endian; its status and length table follows. */
#define HEAD_BYTES 24
enum { HEAD, DATA, DONE, OTHER };                   /* a reply's phase */
/* A reply's state row: its phase, whether it failed, the errno, bytes received, the piece to
 * fill next and its bytes filled, the next row to check. */
enum { S_PHASE, S_FAILED, S_ERRNO, S_RECEIVED, S_FIRST, S_SKIP, S_CHECKED, S_FIELDS };

typedef struct {
    int fd;
    char *head; /* the head and table land here */
    Py_ssize_t head_len;
    const char *table; /* the table of the expected reply */
    int64_t data, lo, hi; /* its shard bytes without prefixes; its rows */
    int64_t *state;
    int64_t total; /* the whole reply's bytes, head included, once its head is in */
    int wake;      /* its socket's SO_RCVLOWAT as set here; 0: untouched (the kernel's 1) */
} reply_t;

/* Wake the poll on r's socket once ``bytes`` are in (at least 1). */
static void
wake_at(reply_t *r, int64_t bytes)
{
    int want = bytes < 1 ? 1 : bytes > WAKE_BYTES ? WAKE_BYTES : (int)bytes;
    if (want == (r->wake ? r->wake : 1))
        return;
    if (setsockopt(r->fd, SOL_SOCKET, SO_RCVLOWAT, &want, sizeof want) == 0)
        r->wake = want;
}

typedef struct {
    Py_buffer *targets;
    Py_ssize_t count;
    int64_t *which, *offsets, *lengths;
    Py_ssize_t columns;
    const int64_t *first_at;
    int64_t first_bytes, max_prefix;
    /* Where rows are shards to check as they land: row's shard is cell = cells[row] = block x k
     * + stripe index; its result (1 holds, 2 fails) goes to sums[cell]; NULL: none checked
     * here. What its header must say: magic, version, k, m, sizes[block], keys[block]. */
    const int64_t *cells;
    uint8_t *sums;
    const int64_t *sizes;
    const uint8_t *keys, *magic;
    int64_t k, m, version;
    void *state; /* xxh3's */
} layout_t;

static uint64_t little(const unsigned char *p, int bytes);
static xxh3_t xxh3;
static int have_xxh3; /* 0 where the xxhash extension exports no xxh3: rows go unchecked */

/* Check the shard in row: its header ends its first piece (ec.shard's layout: checksum, magic,
 * index, version, k, m, size, write, key) and names this block, stripe index and geometry; its
 * fragment is the pieces between, its last piece is the padding (hashed as the zeros it must
 * be, wherever its bytes went). Whether it is of the same write as its block's other shards is
 * the caller's to check. */
static void
check_row(const layout_t *l, int64_t row)
{
    Py_ssize_t p0 = (Py_ssize_t)(row * l->columns), last = p0 + l->columns - 1;
    const uint8_t *head = (const uint8_t *)l->targets[l->which[p0]].buf + l->first_at[row];
    int64_t cell = l->cells[row], block = cell / l->k;
    if (memcmp(head + 8, l->magic, 4) != 0 || head[12] != cell % l->k || head[13] != l->version ||
        head[14] != l->k || head[15] != l->m ||
        little(head + 16, 8) != (uint64_t)l->sizes[block] ||
        memcmp(head + 32, l->keys + 32 * block, 32) != 0) {
        l->sums[cell] = 2;
        return;
    }
    shard_sum_begin(&xxh3, l->state, head);
    for (Py_ssize_t p = p0 + 1; p < last; p++)
        if (l->lengths[p])
            xxh3.update(l->state, (const uint8_t *)l->targets[l->which[p]].buf + l->offsets[p],
                        (size_t)l->lengths[p]);
    l->sums[cell] = shard_sum_holds(&xxh3, l->state, head, l->lengths[last]) ? 1 : 2;
}

static uint64_t
little(const unsigned char *p, int bytes)
{
    uint64_t value = 0;
    while (bytes-- > 0)
        value = value << 8 | p[bytes];
    return value;
}

/* The prefix of a reply whose head is the expected one's (bar the prefix), else -1. */
static int64_t
usual_prefix(const reply_t *r, const layout_t *l)
{
    const unsigned char *h = (const unsigned char *)r->head;
    uint64_t frame = (uint64_t)h[0] << 24 | (uint64_t)h[1] << 16 | (uint64_t)h[2] << 8 | h[3];
    int64_t prefix = (int64_t)little(h + 10, 2), count = (int64_t)little(h + 12, 4);
    uint64_t data = little(h + 16, 8);
    if (memcmp(h + 4, "KVRR", 4) != 0 || h[8] != 0 || prefix > l->max_prefix ||
        count != r->hi - r->lo || data != (uint64_t)(count * prefix + r->data) ||
        frame != (uint64_t)(r->head_len - 4) + data)
        return -1;
    return prefix;
}

static void
fail(int64_t *state, int error)
{
    state[S_FAILED] = 1;
    state[S_ERRNO] = error;
}

/* What a receive on a reply's socket returned: 1 where bytes came (counted), 0 where the reply
 * waits (the socket held none) or failed (the failure recorded), -1 to try again (EINTR). */
static int
took(int64_t *st, ssize_t got)
{
    if (got > 0) {
        st[S_RECEIVED] += got;
        return 1;
    }
    if (got < 0 && errno == EINTR)
        return -1;
    if (got == 0)
        fail(st, 0);
    else if (errno != EAGAIN && errno != EWOULDBLOCK)
        fail(st, errno);
    return 0;
}

/* Take what the socket holds of reply r; it leaves r's phase HEAD or DATA only when the socket
 * held no more. */
static void
step(reply_t *r, const layout_t *l)
{
    int64_t *st = r->state;
    while (st[S_PHASE] == HEAD) {
        Py_ssize_t done = (Py_ssize_t)st[S_RECEIVED];
        ssize_t got = recv(r->fd, r->head + done, (size_t)(r->head_len - done), MSG_DONTWAIT);
        int status = took(st, got);
        if (status <= 0) {
            if (status < 0)
                continue;
            return;
        }
        done += got;
        if (done < HEAD_BYTES)
            continue;
        int64_t prefix = usual_prefix(r, l); /* a head that is not the expected one's: at once */
        if (prefix < 0) {
            st[S_PHASE] = OTHER;
            return;
        }
        if (done < r->head_len)
            continue;
        if (memcmp(r->head + HEAD_BYTES, r->table, (size_t)(r->head_len - HEAD_BYTES)) != 0) {
            st[S_PHASE] = OTHER;
            return;
        }
        for (int64_t row = r->lo; row < r->hi; row++)
            if (l->first_at[row] < prefix) {
                st[S_PHASE] = OTHER;
                return;
            }
        /* Each shard's first piece takes the prefix before its own bytes. */
        for (int64_t row = r->lo; row < r->hi; row++) {
            l->offsets[row * l->columns] = l->first_at[row] - prefix;
            l->lengths[row * l->columns] = l->first_bytes + prefix;
        }
        st[S_PHASE] = DATA;
        r->total = r->head_len + (int64_t)little((const unsigned char *)r->head + 16, 8);
        st[S_FIRST] = r->lo * l->columns;
        st[S_SKIP] = 0;
        st[S_CHECKED] = r->lo;
    }
    if (st[S_PHASE] != DATA)
        return;
    Py_ssize_t end = (Py_ssize_t)(r->hi * l->columns);
    struct iovec iov[MAX_IOV];
    while (st[S_FIRST] < end) {
        size_t asked;
        Py_ssize_t first = (Py_ssize_t)st[S_FIRST], skip = (Py_ssize_t)st[S_SKIP], bad;
        int used = build_iov(iov, l->targets, l->count, l->which, l->offsets, l->lengths, end,
                             first, skip, PY_SSIZE_T_MAX, &asked, &bad);
        if (used < 0) { /* checked before the call: never */
            fail(st, EFAULT);
            return;
        }
        struct msghdr message = {0};
        message.msg_iov = iov;
        message.msg_iovlen = (size_t)used;
        ssize_t got = recvmsg(r->fd, &message, MSG_DONTWAIT);
        int status = took(st, got);
        if (status <= 0) {
            if (status < 0)
                continue;
            return;
        }
        Py_ssize_t left = got;
        while (first < end && left >= l->lengths[first] - skip) {
            left -= l->lengths[first] - skip;
            first++;
            skip = 0;
        }
        st[S_FIRST] = first;
        st[S_SKIP] = skip + left;
        /* Each shard whole now is checked while its bytes are still in the cache. */
        for (; l->sums && st[S_CHECKED] < first / l->columns; st[S_CHECKED]++)
            check_row(l, st[S_CHECKED]);
        if ((size_t)got < asked) { /* a short read: the socket held no more */
            wake_at(r, r->total - st[S_RECEIVED]);
            return;
        }
    }
    st[S_PHASE] = DONE;
}

static double
monotonic(void)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)now.tv_sec + (double)now.tv_nsec * 1e-9;
}

/* When stragglers are given up on (noderests.Stragglers, the same rule for the replies taken in
 * Python): once no more than spare replies are still out and some are in, the rest get factor
 * times what the call took so far, min_s at the least, and then stop where they stand (the
 * reader takes their blocks from parity). spare 0: wait for every reply to the deadline. */
typedef struct {
    Py_ssize_t spare;
    double min_s, factor;
} hedge_t;

/* Poll every reply still in HEAD or DATA and step the ready ones, until none is, the deadline
 * passes or the stragglers' grace (hedge) is over. 0, or EINTR where a signal came (call again
 * once it is handled: the grace starts again). */
static int
take(reply_t *replies, struct pollfd *polls, Py_ssize_t m, const layout_t *l, double deadline,
     const hedge_t *hedge)
{
    double started = monotonic(), give_up = 0.0;
    for (;;) {
        Py_ssize_t active = 0;
        for (Py_ssize_t i = 0; i < m; i++) {
            const int64_t *st = replies[i].state;
            int open = !st[S_FAILED] && (st[S_PHASE] == HEAD || st[S_PHASE] == DATA);
            polls[i].fd = open ? replies[i].fd : -1; /* poll skips a negative one */
            polls[i].events = POLLIN;
            polls[i].revents = 0;
            active += open;
        }
        double now = monotonic();
        if (active && active <= hedge->spare && active < m) {
            if (give_up == 0.0)
                give_up = now + fmax(hedge->min_s, hedge->factor * (now - started));
        } else
            give_up = 0.0;
        double left = (give_up > 0.0 && give_up < deadline ? give_up : deadline) - now;
        if (!active || left <= 0)
            return 0;
        int ready = poll(polls, (nfds_t)m, (int)ceil(left * 1000));
        if (ready < 0)
            return errno == EINTR ? EINTR : 0;
        for (Py_ssize_t i = 0; i < m && ready > 0; i++)
            if (polls[i].fd >= 0 && polls[i].revents) {
                step(&replies[i], l);
                ready--;
            }
    }
}

/* The buffers take_replies is given, held in one array and released together. */
typedef struct {
    Py_buffer *views;
    Py_ssize_t held;
} holds_t;

static Py_buffer *
hold(holds_t *h, PyObject *object, int writable, const char *name)
{
    Py_buffer *view = &h->views[h->held];
    if (contiguous(object, view, writable, name) < 0)
        return NULL;
    h->held++;
    return view;
}

static Py_buffer *
hold_int64(holds_t *h, PyObject *object, int writable, const char *name, Py_ssize_t n)
{
    Py_buffer *view = hold(h, object, writable, name);
    if (view != NULL && view->len != n * 8) {
        PyErr_Format(PyExc_ValueError, "take_replies: %s must hold %zd int64", name, n);
        return NULL;
    }
    return view;
}

static PyObject *
take_replies(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *fds_o, *heads, *tables, *sums_o, *rows_o, *buffers, *arrays_o[3], *first_at_o,
        *state_o, *check_o;
    Py_ssize_t columns;
    long long first_bytes, max_prefix;
    double deadline;
    hedge_t hedge = {0, 0.0, 0.0};
    if (!PyArg_ParseTuple(args, "OO!O!OOO!OOOnOLLdOO|ndd", &fds_o, &PyTuple_Type, &heads,
                          &PyTuple_Type, &tables, &sums_o, &rows_o, &PyTuple_Type, &buffers,
                          &arrays_o[0], &arrays_o[1], &arrays_o[2], &columns, &first_at_o,
                          &first_bytes, &max_prefix, &deadline, &state_o, &check_o, &hedge.spare,
                          &hedge.min_s, &hedge.factor))
        return NULL;
    PyObject *cells_o = NULL, *checked_o = NULL, *sizes_o = NULL, *keys_o = NULL, *magic_o = NULL;
    long long k = 1, parity = 0, version = 0;
    if (check_o != Py_None &&
        !PyArg_ParseTuple(check_o,
                          "OOOOLLOL;take_replies: check is (cells, sums, sizes, keys, k, m, "
                          "magic, version) or None",
                          &cells_o, &checked_o, &sizes_o, &keys_o, &k, &parity, &magic_o, &version))
        return NULL;
    Py_ssize_t m = PyTuple_GET_SIZE(heads), count = PyTuple_GET_SIZE(buffers);
    if (PyTuple_GET_SIZE(tables) != m || count < 1 || count > MAX_BUFFERS || columns < 1 ||
        first_bytes < 0 || max_prefix < 0) {
        PyErr_Format(PyExc_ValueError,
                     "take_replies: a head and a table a reply, 1 to %d buffers, columns >= 1",
                     MAX_BUFFERS);
        return NULL;
    }
    /* The buffers first (views 0 .. count - 1 are the targets), then the arrays, the check's
     * five, a head and a table a reply. */
    holds_t h = {PyMem_Calloc((size_t)(count + 13 + 2 * m), sizeof(Py_buffer)), 0};
    reply_t *replies = PyMem_Calloc((size_t)(m ? m : 1), sizeof(reply_t));
    struct pollfd *polls = PyMem_Calloc((size_t)(m ? m : 1), sizeof(struct pollfd));
    void *hashing = NULL;
    PyObject *result = NULL;
    if (!h.views || !replies || !polls) {
        PyErr_NoMemory();
        goto release;
    }
    for (Py_ssize_t b = 0; b < count; b++)
        if (hold(&h, PyTuple_GET_ITEM(buffers, b), 1, "buffers") == NULL)
            goto release;
    Py_buffer *targets = h.views, *arrays[3];
    static const char *names[3] = {"which", "offsets", "lengths"};
    for (int a = 0; a < 3; a++)
        if ((arrays[a] = hold(&h, arrays_o[a], 1, names[a])) == NULL)
            goto release;
    Py_ssize_t pieces = arrays[0]->len / 8, total_rows = pieces / columns;
    if (arrays[0]->len % 8 || arrays[1]->len != arrays[0]->len ||
        arrays[2]->len != arrays[0]->len || pieces % columns) {
        PyErr_SetString(PyExc_ValueError,
                        "take_replies: which, offsets, lengths: rows x columns int64 each");
        goto release;
    }
    Py_buffer *fds, *sums, *rows, *first_at, *state;
    if ((fds = hold_int64(&h, fds_o, 0, "fds", m)) == NULL ||
        (sums = hold_int64(&h, sums_o, 0, "sums", m)) == NULL ||
        (rows = hold_int64(&h, rows_o, 0, "rows", 2 * m)) == NULL ||
        (first_at = hold_int64(&h, first_at_o, 0, "first_at", total_rows)) == NULL ||
        (state = hold_int64(&h, state_o, 1, "state", S_FIELDS * m)) == NULL)
        goto release;
    Py_buffer *cells = NULL, *checked = NULL, *sizes = NULL, *keys = NULL, *magic = NULL;
    if (cells_o != NULL && have_xxh3) { /* without xxh3 the caller checks the rows itself */
        if ((keys = hold(&h, keys_o, 0, "keys")) == NULL ||
            (magic = hold(&h, magic_o, 0, "magic")) == NULL)
            goto release;
        if (columns < 2 || k < 1 || parity < 0 || magic->len != 4 || keys->len % 32) {
            PyErr_SetString(PyExc_ValueError,
                            "take_replies: a checked row has 2 pieces or more, k >= 1, m >= 0, "
                            "a 4-byte magic, 32-byte keys");
            goto release;
        }
        Py_ssize_t blocks = keys->len / 32;
        if ((sizes = hold_int64(&h, sizes_o, 0, "sizes", blocks)) == NULL ||
            (cells = hold_int64(&h, cells_o, 0, "cells", total_rows)) == NULL ||
            (checked = hold(&h, checked_o, 1, "sums")) == NULL)
            goto release;
        const int64_t *cell = cells->buf;
        for (Py_ssize_t row = 0; row < total_rows; row++)
            if (cell[row] < 0 || cell[row] >= checked->len || cell[row] / k >= blocks) {
                PyErr_Format(PyExc_ValueError, "take_replies: row %zd's cell is outside sums", row);
                goto release;
            }
        if ((hashing = xxh3.create_state()) == NULL) {
            PyErr_NoMemory();
            goto release;
        }
    }
    const int64_t *which = arrays[0]->buf, *offsets = arrays[1]->buf, *lengths = arrays[2]->buf;
    const int64_t *at0 = first_at->buf, *span = rows->buf;
    /* Every piece a reply may fill is checked here, once: the loop runs without the GIL. */
    for (Py_ssize_t i = 0; i < m; i++) {
        reply_t *r = &replies[i];
        Py_buffer *head = hold(&h, PyTuple_GET_ITEM(heads, i), 1, "heads");
        Py_buffer *table = head ? hold(&h, PyTuple_GET_ITEM(tables, i), 0, "tables") : NULL;
        if (table == NULL)
            goto release;
        r->fd = (int)((const int64_t *)fds->buf)[i];
        r->head = head->buf;
        r->head_len = head->len;
        r->table = table->buf;
        r->data = ((const int64_t *)sums->buf)[i];
        r->lo = span[2 * i];
        r->hi = span[2 * i + 1];
        r->state = (int64_t *)state->buf + S_FIELDS * i;
        if (r->fd < 0 || r->head_len != HEAD_BYTES + table->len || r->lo < 0 ||
            r->hi <= r->lo || r->hi > total_rows || r->data < 0) {
            PyErr_Format(PyExc_ValueError, "take_replies: reply %zd is not one to take", i);
            goto release;
        }
        for (int64_t row = r->lo; row < r->hi; row++)
            for (Py_ssize_t c = 0; c < columns; c++) {
                Py_ssize_t p = (Py_ssize_t)(row * columns + c);
                int64_t b = which[p], at = c ? offsets[p] : at0[row];
                int64_t len = c ? lengths[p] : first_bytes;
                if (c && len == 0) /* an empty piece takes no byte, wherever it points */
                    continue;
                if (b < 0 || b >= count || at < 0 || len < 0 || at > targets[b].len ||
                    len > targets[b].len - at) {
                    PyErr_Format(PyExc_ValueError,
                                 "take_replies: piece %zd names bytes outside its buffer", p);
                    goto release;
                }
            }
        memset(r->state, 0, S_FIELDS * sizeof(int64_t));
    }
    layout_t layout = {targets, count, arrays[0]->buf, arrays[1]->buf, arrays[2]->buf, columns,
                       at0, first_bytes, max_prefix, hashing ? cells->buf : NULL,
                       hashing ? checked->buf : NULL, hashing ? sizes->buf : NULL,
                       hashing ? keys->buf : NULL, hashing ? magic->buf : NULL, k, parity,
                       version, hashing};
    int error;
    do {
        Py_BEGIN_ALLOW_THREADS
        error = take(replies, polls, m, &layout, deadline, &hedge);
        for (Py_ssize_t i = 0; i < m; i++)
            if (replies[i].wake > 1)
                wake_at(&replies[i], 1); /* the kernel's default, for whoever reads next */
        Py_END_ALLOW_THREADS
    } while (error == EINTR && PyErr_CheckSignals() == 0);
    if (!PyErr_Occurred())
        result = Py_NewRef(Py_None);
release:
    if (hashing)
        xxh3.free_state(hashing);
    while (h.held > 0)
        PyBuffer_Release(&h.views[--h.held]);
    PyMem_Free(polls);
    PyMem_Free(replies);
    PyMem_Free(h.views);
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
    {"take_replies", take_replies, METH_VARARGS,
     "take_replies(fds, heads, tables, sums, rows, buffers, which, offsets, lengths, columns, "
     "first_at, first_bytes, max_prefix, deadline, state, check, spare=0, min_s=0, factor=0) -> "
     "None: take reply i from socket "
     "fds[i], its head and table into heads[i]; if they are the expected reply's (the table "
     "is tables[i], the shard bytes sums[i] plus a prefix of at most max_prefix a shard), its "
     "shards (rows rows[2i] .. rows[2i+1], columns pieces each, as recv_pieces names them) are "
     "received into their pieces, the prefix first into each row's first piece (offsets and "
     "lengths of column 0 set to first_at[row] - prefix, first_bytes + prefix). Until every "
     "reply is done, failed or not the expected one, or the monotonic clock passes deadline, "
     "or no more than spare replies are still out (some in) and a grace of factor times the "
     "call's time so far (min_s at the least) has passed since. "
     "state[7i:7i+7]: phase (0 head, 1 data, 2 done, 3 not the expected reply, its head in), "
     "failed, errno (0: the end of the stream), bytes received, the piece to fill next and its "
     "bytes filled, the next row to check. check: None, or (cells, sums, sizes, keys, k, m, "
     "magic, version): each row is shard cells[row] = block x k + index (its header ends its "
     "first piece, its last piece is zero padding), checked as it lands: its header's magic, "
     "index, version, k, m, size (sizes[block]) and key (keys[32 block:]), and its checksum; "
     "sums[cells[row]] set to 1 where all hold, 2 where not (left 0 where the xxhash "
     "extension has no xxh3)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvstore.blockstore._recvpieces", "The direct reader's scatter receive in C.", -1, methods,
};

PyMODINIT_FUNC
PyInit__recvpieces(void)
{
    have_xxh3 = find_xxh3(&xxh3, "_recvpieces") == 0;
    PyErr_Clear(); /* without xxh3 the receives serve all the same */
    return PyModule_Create(&module);
}

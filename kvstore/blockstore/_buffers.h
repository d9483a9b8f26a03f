/* What the block tier's C extensions (_probe.c, _shardsums.c, _recvpieces.c, _sendrecords.c,
 * _keymix.c) share: taking a Python buffer argument as one C-contiguous block of memory, or a
 * TypeError naming it; and several at once. */
#ifndef KVSTORE_BLOCKSTORE_BUFFERS_H
#define KVSTORE_BLOCKSTORE_BUFFERS_H

#include <Python.h>

static int
contiguous(PyObject *object, Py_buffer *view, int writable, const char *name)
{
    int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(object, view, flags) < 0) {
        PyErr_Format(PyExc_TypeError, "%s: must be a C-contiguous%s buffer", name,
                     writable ? " writable" : "");
        return -1;
    }
    return 0;
}

/* Take count arguments as C-contiguous buffers, those from writable_from on writable: 0, or
 * -1 with the error set and none of them held. */
static inline int
take_all(PyObject *const *objects, Py_buffer *views, int count, int writable_from,
         const char *const *names)
{
    for (int taken = 0; taken < count; taken++)
        if (contiguous(objects[taken], &views[taken], taken >= writable_from, names[taken]) < 0) {
            while (taken-- > 0)
                PyBuffer_Release(&views[taken]);
            return -1;
        }
    return 0;
}

static inline void
release_all(Py_buffer *views, int count)
{
    while (count-- > 0)
        PyBuffer_Release(&views[count]);
}

#endif

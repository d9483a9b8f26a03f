/* What the block tier's C extensions (_probe.c, _shardsums.c, _recvpieces.c, _sendrecords.c,
 * _keymix.c) share: taking a Python buffer argument as one C-contiguous block of memory, or a
 * TypeError naming it. */
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

#endif

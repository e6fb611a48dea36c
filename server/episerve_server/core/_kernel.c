/* The warm read path's inner loops (episerve_server.core.kernel has the same functions in
 * numpy and says what each computes). Plain C over the buffer protocol: every argument is
 * a contiguous int64 buffer or an int, so no numpy headers are needed to build it, and
 * every index read from one buffer into another is bounds-checked here (a bad index
 * answers -1: the caller falls back to the general path, nothing is read out of range). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

typedef struct {
    Py_buffer view;
    int64_t *p;
    Py_ssize_t n;
} I64;

static int get_i64(PyObject *obj, I64 *out, int writable) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, &out->view, flags) < 0) return -1;
    if (out->view.itemsize != 8 || out->view.format == NULL
        || (strcmp(out->view.format, "l") != 0 && strcmp(out->view.format, "q") != 0
            && strcmp(out->view.format, "<q") != 0 && strcmp(out->view.format, "=q") != 0
            && strcmp(out->view.format, "<l") != 0 && strcmp(out->view.format, "=l") != 0)) {
        PyBuffer_Release(&out->view);
        PyErr_SetString(PyExc_TypeError, "the kernel takes contiguous int64 buffers only");
        return -1;
    }
    out->p = (int64_t *)out->view.buf;
    out->n = out->view.len / 8;
    return 0;
}

static void release(I64 *bufs, int n) {
    for (int i = 0; i < n; i++)
        if (bufs[i].p != NULL) PyBuffer_Release(&bufs[i].view);
}

static int get_all(PyObject **objs, I64 *bufs, const int *writable, int n) {
    for (int i = 0; i < n; i++) bufs[i].p = NULL;
    for (int i = 0; i < n; i++) {
        if (get_i64(objs[i], &bufs[i], writable[i]) < 0) {
            bufs[i].p = NULL;
            release(bufs, i);
            return -1;
        }
    }
    return 0;
}

/* key_base(tbase, tsize, tslab, uids, base_out, size_out) -> slab, or -1 if a uid is past
 * the table, not indexed there, or the uids' chunks lie in more than one slab. */
static PyObject *key_base(PyObject *self, PyObject *args) {
    PyObject *o[6];
    if (!PyArg_ParseTuple(args, "OOOOOO", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5]))
        return NULL;
    static const int w[6] = {0, 0, 0, 0, 1, 1};
    I64 b[6];
    if (get_all(o, b, w, 6) < 0) return NULL;
    int64_t n = b[3].n, slab = -2, tn = b[0].n;
    if (b[4].n < n || b[5].n < n || b[1].n < tn || b[2].n < tn) {
        release(b, 6);
        PyErr_SetString(PyExc_ValueError, "key_base: output or table buffers too short");
        return NULL;
    }
    for (int64_t i = 0; i < n; i++) {
        int64_t u = b[3].p[i];
        if (u < 0 || u >= tn || b[0].p[u] < 0) { slab = -1; break; }
        int64_t s = b[2].p[u];
        if (slab == -2) slab = s;
        if (s != slab || s < 0) { slab = -1; break; }
        b[4].p[i] = b[0].p[u];
        b[5].p[i] = b[1].p[u];
    }
    release(b, 6);
    return PyLong_FromLongLong(n ? slab : -1);
}

/* resolve(flat, base, chunk, within, width, rows_per_slot, time_axis, slots_out, idx_out)
 * -> 0, or -1 if a chunk is not cached (a slot < 0) or a position is outside ``flat``.
 * Per sample i and window step j (chunk and within are (B, width)):
 *   slots_out[i, j] = flat[base[i] + chunk[i, j]]
 *   idx_out[i, j] = slots_out[i, j] * rows_per_slot + within[i, j]   (time_axis)
 *   idx_out[i] = slots_out[i, 0] * rows_per_slot + within[i, 0]       (otherwise) */
static PyObject *resolve(PyObject *self, PyObject *args) {
    PyObject *o[6];
    long long width, rps;
    int time_axis;
    if (!PyArg_ParseTuple(args, "OOOOLLpOO", &o[0], &o[1], &o[2], &o[3], &width, &rps,
                          &time_axis, &o[4], &o[5]))
        return NULL;
    static const int w[6] = {0, 0, 0, 0, 1, 1};
    I64 b[6];
    if (get_all(o, b, w, 6) < 0) return NULL;
    int64_t n = b[1].n, nflat = b[0].n;
    const int64_t *flat = b[0].p, *base = b[1].p, *chunk = b[2].p, *within = b[3].p;
    int64_t *slots = b[4].p, *idx = b[5].p;
    if (width <= 0 || b[2].n < n * width || b[3].n < n * width || b[4].n < n * width
        || b[5].n < (time_axis ? n * width : n)) {
        release(b, 6);
        PyErr_SetString(PyExc_ValueError, "resolve: buffers do not match the batch");
        return NULL;
    }
    long rc = 0;
    for (int64_t i = 0; i < n && !rc; i++) {
        const int64_t *c = chunk + i * width, *r = within + i * width;
        int64_t *s = slots + i * width;
        for (int64_t j = 0; j < width; j++) {
            int64_t pos = base[i] + c[j];
            int64_t slot = (pos >= 0 && pos < nflat) ? flat[pos] : -1;
            if (slot < 0) { rc = -1; break; }
            s[j] = slot;
            if (time_axis) idx[i * width + j] = slot * rps + r[j];
        }
        if (!rc && !time_axis) idx[i] = s[0] * rps + r[0];
    }
    release(b, 6);
    return PyLong_FromLong(rc);
}

/* stamp(stamps, slots, clock) -> how many distinct slots ``slots`` names; each gets
 * ``clock``. The clock is newer than every stamp already there, so a slot is counted
 * the first time it is met. -1 (nothing stamped) if a slot is outside ``stamps``. */
static PyObject *stamp(PyObject *self, PyObject *args) {
    PyObject *o[2];
    long long clock;
    if (!PyArg_ParseTuple(args, "OOL", &o[0], &o[1], &clock)) return NULL;
    static const int w[2] = {1, 0};
    I64 b[2];
    if (get_all(o, b, w, 2) < 0) return NULL;
    int64_t *st = b[0].p, ns = b[0].n, count = 0;
    for (int64_t i = 0; i < b[1].n; i++)
        if (b[1].p[i] < 0 || b[1].p[i] >= ns) { count = -1; break; }
    for (int64_t i = 0; i < b[1].n && count >= 0; i++) {
        int64_t s = b[1].p[i];
        if (st[s] != clock) { st[s] = clock; count++; }
    }
    release(b, 2);
    return PyLong_FromLongLong(count);
}

static PyMethodDef methods[] = {
    {"key_base", key_base, METH_VARARGS, "per sample, its episode's table start and size"},
    {"resolve", resolve, METH_VARARGS, "slots and gather rows of one output"},
    {"stamp", stamp, METH_VARARGS, "stamp slots, count the distinct ones"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_kernel", "The warm read path's inner loops.", -1, methods,
};

PyMODINIT_FUNC PyInit__kernel(void) { return PyModule_Create(&module); }

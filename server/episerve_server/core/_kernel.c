/* The warm read path's inner loops (episerve_server.core.kernel has the same functions in
 * numpy and says what each computes). Plain C over the buffer protocol: every argument is
 * a contiguous int64 buffer or an int, so no numpy headers are needed to build it, and
 * every index read from one buffer into another is bounds-checked here (a bad index
 * answers -1: the caller locates the batch with numpy, nothing is read out of range). */
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

/* A contiguous writable buffer of one-byte items (numpy bool or uint8). */
static int get_u8(PyObject *obj, Py_buffer *view) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) < 0)
        return -1;
    if (view->itemsize != 1 || view->format == NULL
        || (strcmp(view->format, "?") != 0 && strcmp(view->format, "B") != 0)) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_TypeError, "the kernel takes contiguous bool buffers only");
        return -1;
    }
    return 0;
}

/* Whether a * b (both >= 0) neither wraps nor passes ``limit``: every check of a buffer's
 * length against a product of the caller's values goes through here, so a caller's huge
 * value is a refusal, not a product that wraps to a small one and passes the check. */
static int fits(int64_t a, int64_t b, int64_t limit) {
    int64_t p;
    return a >= 0 && b >= 0 && !__builtin_mul_overflow(a, b, &p) && p <= limit;
}

/* a + b, or the int64 bound it passes (values only: never an index). */
static int64_t add_sat(int64_t a, int64_t b) {
    int64_t r;
    if (!__builtin_add_overflow(a, b, &r)) return r;
    return b > 0 ? INT64_MAX : INT64_MIN;
}

/* a - b, or the int64 bound it passes (values only: never an index). */
static int64_t sub_sat(int64_t a, int64_t b) {
    int64_t r;
    if (!__builtin_sub_overflow(a, b, &r)) return r;
    return b > 0 ? INT64_MIN : INT64_MAX;
}

/* a * b, or the int64 bound it passes (values only: never an index). */
static int64_t mul_sat(int64_t a, int64_t b) {
    int64_t r;
    if (!__builtin_mul_overflow(a, b, &r)) return r;
    return (a < 0) != (b < 0) ? INT64_MIN : INT64_MAX;
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

/* The loop of key_base (below): per sample, its table start and serving limit into
 * ``base`` and ``limit``. Returns the one slab every sample's chunks are in, or -1 (a uid
 * past the table or not indexed there, an id past ``rows_of``, several slabs, no sample);
 * ``shorter`` (when given) says whether a limit falls below its sample's ``total``. The
 * table buffers are at least ``tn`` long (the callers check). */
static int64_t key_rows(const int64_t *tbase, const int64_t *tsize, const int64_t *tslab,
                        int64_t tn, const int64_t *rows_of, int64_t rn, const int64_t *uids,
                        const int64_t *ids, const int64_t *total, int64_t n, int64_t c,
                        int64_t *base, int64_t *limit, int *shorter) {
    int64_t slab = -2;
    for (int64_t i = 0; i < n; i++) {
        int64_t u = uids[i], d = ids[i];
        if (u < 0 || u >= tn || tbase[u] < 0 || d < 0 || d >= rn) return -1;
        if (slab == -2) slab = tslab[u];
        if (tslab[u] != slab || slab < 0) return -1;
        int64_t lim = mul_sat(tsize[u], c);
        if (rows_of[d] < lim) lim = rows_of[d];
        base[i] = tbase[u];
        limit[i] = lim;
        if (shorter != NULL && lim < total[i]) *shorter = 1;
    }
    return n ? slab : -1;
}

/* The loop of resolve (below) over (n, width) rows: 0, or -1 if a row is negative or (with
 * ``limit``) at or past its sample's limit, or its chunk's position is outside ``flat`` or
 * not cached. A window's rows mostly follow one another: the next row's chunk and place in
 * it come from the last one's without a division (the slot is looked up only when the
 * chunk changes). */
static int resolve_rows(const int64_t *flat, int64_t nflat, const int64_t *base,
                        const int64_t *limit, const int64_t *rows, int64_t n, int64_t width,
                        int64_t c, int64_t rps, int time_axis, int64_t *slots, int64_t *idx) {
    for (int64_t i = 0; i < n; i++) {
        const int64_t *r = rows + i * width;
        int64_t *s = slots + i * width;
        int64_t last = -2, chunk = 0, within = 0, slot = -1;
        for (int64_t j = 0; j < width; j++) {
            int64_t row = r[j];
            if (row < 0 || (limit != NULL && row >= limit[i])) return -1;
            if (row == last + 1 && within + 1 < c) {
                within++;
            } else if (row != last) {
                int64_t was = chunk;
                chunk = row / c;
                within = row - chunk * c;
                if (chunk != was || slot < 0) {
                    int64_t pos = base[i] + chunk;
                    slot = (pos >= 0 && pos < nflat) ? flat[pos] : -1;
                    if (slot < 0) return -1;
                }
            }
            last = row;
            s[j] = slot;
            if (time_axis) idx[i * width + j] = slot * rps + within;
        }
        if (!time_axis) idx[i] = s[0] * rps + r[0] % c;
    }
    return 0;
}

/* key_base(tbase, tsize, tslab, uids, rows_of, ids, total, chunk_rows, base_out, limit_out)
 * -> 2 * slab + short, or -1 if a uid is past the table or not indexed there, an id is past
 * ``rows_of``, or the uids' chunks lie in more than one slab. Per sample i:
 *   base_out[i] = tbase[uids[i]]   (its episode's start in the slot table)
 *   limit_out[i] = min(rows_of[ids[i]], tsize[uids[i]] * chunk_rows)   (rows it can serve)
 * and ``short`` is 1 if any limit falls below its episode's ``total``. */
static PyObject *key_base(PyObject *self, PyObject *args) {
    PyObject *o[9];
    long long c;
    if (!PyArg_ParseTuple(args, "OOOOOOOLOO", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5],
                          &o[6], &c, &o[7], &o[8]))
        return NULL;
    static const int w[9] = {0, 0, 0, 0, 0, 0, 0, 1, 1};
    I64 b[9];
    if (get_all(o, b, w, 9) < 0) return NULL;
    int64_t n = b[3].n, tn = b[0].n;
    int shorter = 0;
    if (b[5].n < n || b[6].n < n || b[7].n < n || b[8].n < n || b[1].n < tn || b[2].n < tn) {
        release(b, 9);
        PyErr_SetString(PyExc_ValueError, "key_base: output or table buffers too short");
        return NULL;
    }
    int64_t slab = key_rows(b[0].p, b[1].p, b[2].p, tn, b[4].p, b[4].n, b[3].p, b[5].p, b[6].p,
                            n, c, b[7].p, b[8].p, &shorter);
    release(b, 9);
    return PyLong_FromLongLong(slab >= 0 ? 2 * slab + shorter : -1);
}

/* resolve(flat, base, rows, chunk_rows, rows_per_slot, time_axis, slots_out, idx_out)
 * -> 0, or -1 if a chunk is not cached (a slot < 0), a row is negative or a position is
 * outside ``flat``. Per sample i and window step j (rows is (B, W)), with
 * chunk = rows[i, j] / chunk_rows and within = rows[i, j] % chunk_rows:
 *   slots_out[i, j] = flat[base[i] + chunk]
 *   idx_out[i, j] = slots_out[i, j] * rows_per_slot + within   (time_axis)
 *   idx_out[i] = the same for j = 0                               (otherwise) */
static PyObject *resolve(PyObject *self, PyObject *args) {
    PyObject *o[5];
    long long c, rps;
    int time_axis;
    if (!PyArg_ParseTuple(args, "OOOLLpOO", &o[0], &o[1], &o[2], &c, &rps, &time_axis,
                          &o[3], &o[4]))
        return NULL;
    static const int w[5] = {0, 0, 0, 1, 1};
    I64 b[5];
    if (get_all(o, b, w, 5) < 0) return NULL;
    int64_t n = b[1].n, nflat = b[0].n;
    int64_t width = n ? b[2].n / n : 0;
    const int64_t *flat = b[0].p, *base = b[1].p, *rows = b[2].p;
    int64_t *slots = b[3].p, *idx = b[4].p;
    if (c <= 0 || (n && (width <= 0 || b[2].n != n * width)) || b[3].n < n * width
        || b[4].n < (time_axis ? n * width : n)) {
        release(b, 5);
        PyErr_SetString(PyExc_ValueError, "resolve: buffers do not match the batch");
        return NULL;
    }
    long rc = resolve_rows(flat, nflat, base, NULL, rows, n, width, c, rps, time_axis, slots,
                           idx);
    release(b, 5);
    return PyLong_FromLong(rc);
}

/* horizon(frame, total, h, rows_out, mask_out): the next ``h`` frames, clamped to the
 * episode: with end = min(frame[i] + h, total[i]),
 *   rows_out[i, j] = min(frame[i] + j, end - 1), mask_out[i, j] = frame[i] + j < end. */
static PyObject *horizon(PyObject *self, PyObject *args) {
    PyObject *o[3], *m;
    long long h;
    if (!PyArg_ParseTuple(args, "OOLOO", &o[0], &o[1], &h, &o[2], &m)) return NULL;
    static const int w[3] = {0, 0, 1};
    I64 b[3];
    if (get_all(o, b, w, 3) < 0) return NULL;
    Py_buffer mv;
    if (get_u8(m, &mv) < 0) { release(b, 3); return NULL; }
    int64_t n = b[0].n;
    if (h <= 0 || b[1].n < n || !fits(n, h, b[2].n) || !fits(n, h, mv.len)) {
        PyBuffer_Release(&mv);
        release(b, 3);
        PyErr_SetString(PyExc_ValueError, "horizon: buffers do not match the batch");
        return NULL;
    }
    unsigned char *mask = (unsigned char *)mv.buf;
    for (int64_t i = 0; i < n; i++) {
        int64_t f = b[0].p[i], fh = add_sat(f, h), end = fh < b[1].p[i] ? fh : b[1].p[i];
        int64_t *r = b[2].p + i * h;
        unsigned char *k = mask + i * h;
        for (int64_t j = 0; j < h; j++) {
            int64_t fj = add_sat(f, j), last = add_sat(end, -1);
            r[j] = fj < last ? fj : last;
            k[j] = fj < end;
        }
    }
    PyBuffer_Release(&mv);
    release(b, 3);
    Py_RETURN_NONE;
}

/* history(newest, stride, stride_all, k, rows_out, mask_out): ``k`` frames back from
 * ``newest``, oldest first, ``stride`` apart (per sample; ``stride_all`` for all when
 * ``stride`` is empty): idx = newest[i] - stride * (k - 1 - j); mask_out = idx >= 0;
 * rows_out = idx where real, else the sample's first real row (0 if none is). */
static PyObject *history(PyObject *self, PyObject *args) {
    PyObject *o[3], *m;
    long long all, k;
    if (!PyArg_ParseTuple(args, "OOLLOO", &o[0], &o[1], &all, &k, &o[2], &m)) return NULL;
    static const int w[3] = {0, 0, 1};
    I64 b[3];
    if (get_all(o, b, w, 3) < 0) return NULL;
    Py_buffer mv;
    if (get_u8(m, &mv) < 0) { release(b, 3); return NULL; }
    int64_t n = b[0].n;
    int per_sample = b[1].n > 0;
    if (k <= 0 || (per_sample && b[1].n < n) || !fits(n, k, b[2].n) || !fits(n, k, mv.len)) {
        PyBuffer_Release(&mv);
        release(b, 3);
        PyErr_SetString(PyExc_ValueError, "history: buffers do not match the batch");
        return NULL;
    }
    unsigned char *mask = (unsigned char *)mv.buf;
    for (int64_t i = 0; i < n; i++) {
        int64_t stride = per_sample ? b[1].p[i] : all, fill = 0, found = 0;
        int64_t *r = b[2].p + i * k;
        unsigned char *q = mask + i * k;
        for (int64_t j = 0; j < k; j++) {
            r[j] = sub_sat(b[0].p[i], mul_sat(stride, k - 1 - j));
            if (r[j] == INT64_MIN) r[j] = -1;  /* before the episode, however far */
            q[j] = r[j] >= 0;
            if (q[j] && !found) { fill = r[j]; found = 1; }
        }
        for (int64_t j = 0; j < k; j++)
            if (!q[j]) r[j] = fill;
    }
    PyBuffer_Release(&mv);
    release(b, 3);
    Py_RETURN_NONE;
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

/* plan_keys(keys, windows, slab_rows, uids, ids, total, scratch, slots_out, idx_out)
 * -> a tuple of each key's slab, or None (not served here: a uid, chunk or row the tables
 * do not hold, a window row at or past what the key can serve, several slabs). What
 * key_base and then resolve for each of its outputs do, for every numeric key of a batch
 * in one call. ``keys`` is a tuple of (tbase, tsize, tslab, flat, rows_of, chunk_rows,
 * outputs), ``outputs`` a tuple of (window, width, time_axis, slots_at, idx_at): the index
 * of its rows in ``windows`` (a tuple of (B, W) int64 arrays), W, and where its slots and
 * rows go in ``slots_out`` and ``idx_out``, in units of the batch size B. ``slab_rows`` holds each
 * slab's rows per slot; ``scratch`` 2B int64 (the bases and limits of the key at hand). */
static PyObject *plan_keys(PyObject *self, PyObject *args) {
    PyObject *keys, *windows, *o[7];
    if (!PyArg_ParseTuple(args, "O!O!OOOOOOO", &PyTuple_Type, &keys, &PyTuple_Type, &windows,
                          &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &o[6]))
        return NULL;
    /* slab_rows, uids, ids, total, scratch, slots_out, idx_out */
    static const int w[7] = {0, 0, 0, 0, 1, 1, 1};
    I64 b[7];
    if (get_all(o, b, w, 7) < 0) return NULL;
    I64 slots_b = b[5], out_idx = b[6];
    int64_t n = b[1].n;
    Py_ssize_t nk = PyTuple_GET_SIZE(keys), nw = PyTuple_GET_SIZE(windows);
    PyObject *result = PyTuple_New(nk);
    int fail = result == NULL ? 2 : 0;  /* 1: not served, 2: a Python error is set */
    if (!fail && (b[2].n < n || b[3].n < n || b[4].n < 2 * n)) {
        PyErr_SetString(PyExc_ValueError, "plan_keys: buffers do not match the batch");
        fail = 2;
    }
    int64_t *base = b[4].p, *limit = b[4].p + n;
    for (Py_ssize_t k = 0; k < nk && !fail; k++) {
        PyObject *spec = PyTuple_GET_ITEM(keys, k), *outs = NULL, *ko[5];
        long long c;
        if (!PyTuple_Check(spec) || !PyArg_ParseTuple(spec, "OOOOOLO!", &ko[0], &ko[1], &ko[2],
                                                      &ko[3], &ko[4], &c, &PyTuple_Type, &outs)) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError, "plan_keys: a key is a tuple");
            fail = 2;
            break;
        }
        static const int kw[5] = {0, 0, 0, 0, 0};
        I64 t[5];  /* tbase tsize tslab flat rows_of */
        if (get_all(ko, t, kw, 5) < 0) { fail = 2; break; }
        int64_t tn = t[0].n, slab = -1;
        if (c <= 0 || t[1].n < tn || t[2].n < tn) {
            PyErr_SetString(PyExc_ValueError, "plan_keys: a key's tables do not match");
            fail = 2;
        }
        if (!fail) {
            slab = key_rows(t[0].p, t[1].p, t[2].p, tn, t[4].p, t[4].n, b[1].p, b[2].p, NULL, n,
                            c, base, limit, NULL);
            if (slab < 0 || slab >= b[0].n) fail = 1;
        }
        int64_t rps = fail ? 0 : b[0].p[slab];
        const int64_t *flat = t[3].p;
        int64_t nflat = t[3].n;
        for (Py_ssize_t e = 0; e < PyTuple_GET_SIZE(outs) && !fail; e++) {
            Py_ssize_t wi, width, sat, iat;
            int time_axis;
            PyObject *entry = PyTuple_GET_ITEM(outs, e);
            if (!PyTuple_Check(entry)
                || !PyArg_ParseTuple(entry, "nnpnn", &wi, &width, &time_axis, &sat, &iat)) {
                if (!PyErr_Occurred())
                    PyErr_SetString(PyExc_TypeError, "plan_keys: an output is a tuple");
                fail = 2;
                break;
            }
            if (wi < 0 || wi >= nw) {
                PyErr_SetString(PyExc_ValueError, "plan_keys: no such window");
                fail = 2;
                break;
            }
            I64 rows_b;
            if (get_i64(PyTuple_GET_ITEM(windows, wi), &rows_b, 0) < 0) { fail = 2; break; }
            /* (each offset and width far below 2^30: the products below cannot wrap) */
            if (width <= 0 || width > (1 << 30) || sat < 0 || sat > (1 << 30) || iat < 0
                || iat > (1 << 30) || n > (1 << 30) || rows_b.n != n * width
                || (sat + width) * n > slots_b.n
                || (iat + (time_axis ? width : 1)) * n > out_idx.n) {
                PyBuffer_Release(&rows_b.view);
                PyErr_SetString(PyExc_ValueError, "plan_keys: an output does not fit");
                fail = 2;
                break;
            }
            if (resolve_rows(flat, nflat, base, limit, rows_b.p, n, width, c, rps, time_axis,
                             slots_b.p + sat * n, out_idx.p + iat * n) < 0)
                fail = 1;
            PyBuffer_Release(&rows_b.view);
        }
        release(t, 5);
        if (!fail) {
            PyObject *got = PyLong_FromLongLong(slab);
            if (got == NULL) fail = 2;
            else PyTuple_SET_ITEM(result, k, got);
        }
    }
    release(b, 7);
    if (fail) {
        Py_XDECREF(result);
        if (fail == 2) return NULL;
        Py_RETURN_NONE;
    }
    return result;
}

/* place_blobs(dst, blobs, at, start, align) -> (end, copied): each blob of the list
 * ``blobs`` whose entry of the list ``at`` is None goes at the next ``align``-aligned
 * offset from ``start`` (in list order); ``end`` is where the last one ends, aligned, and
 * ``copied`` their bytes. With ``dst`` (a writable buffer) and ``end`` within it, each such
 * entry of ``at`` becomes its offset and the blob is copied there; with ``dst`` None, or
 * ``end`` past it, nothing is written (the layout alone). With ``nogil`` (called from a
 * worker thread) each copy is made without the GIL. */
static PyObject *place_blobs(PyObject *self, PyObject *args) {
    PyObject *dst, *blobs_l, *at;
    Py_ssize_t start, align;
    int nogil = 0;
    if (!PyArg_ParseTuple(args, "OO!O!nn|p", &dst, &PyList_Type, &blobs_l, &PyList_Type, &at,
                          &start, &align, &nogil))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(blobs_l);
    if (PyList_GET_SIZE(at) != n || align <= 0 || (align & (align - 1)) || start < 0
        || (start & (align - 1))) {
        PyErr_SetString(PyExc_ValueError, "place_blobs: bad arguments");
        return NULL;
    }
    /* the blobs as they are now (a buffer's export, or another thread while the GIL is
     * released, may change the list); ``at`` is looked at again before each access */
    PyObject *blobs = PyList_AsTuple(blobs_l);
    if (blobs == NULL) return NULL;
    Py_ssize_t end = start, copied = 0, mask = align - 1;
    int fail = 0;
    for (Py_ssize_t i = 0; i < n && !fail; i++) {
        if (i >= PyList_GET_SIZE(at)) { fail = 2; break; }
        if (PyList_GET_ITEM(at, i) != Py_None) continue;
        PyObject *b = PyTuple_GET_ITEM(blobs, i);
        Py_ssize_t size;
        if (PyBytes_CheckExact(b)) {
            size = PyBytes_GET_SIZE(b);
        } else {
            Py_buffer v;
            if (PyObject_GetBuffer(b, &v, PyBUF_C_CONTIGUOUS) < 0) { fail = 1; break; }
            size = v.len;
            PyBuffer_Release(&v);
        }
        if (size > PY_SSIZE_T_MAX / 2 - end - mask) {
            PyErr_SetString(PyExc_OverflowError, "place_blobs: the blobs are too large");
            fail = 1;
            break;
        }
        end += (size + mask) & ~mask;
        copied += size;
    }
    if (fail || dst == Py_None) goto done;
    Py_buffer d;
    if (PyObject_GetBuffer(dst, &d, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        fail = 1;
        goto done;
    }
    if (end > d.len) {
        PyBuffer_Release(&d);
        goto done;
    }
    Py_ssize_t off = start;
    for (Py_ssize_t i = 0; i < n && !fail; i++) {
        if (i >= PyList_GET_SIZE(at)) { fail = 2; break; }
        if (PyList_GET_ITEM(at, i) != Py_None) continue;
        PyObject *b = PyTuple_GET_ITEM(blobs, i);
        Py_buffer v;
        if (PyObject_GetBuffer(b, &v, PyBUF_C_CONTIGUOUS) < 0) { fail = 1; break; }
        /* a blob may have changed under a buffer's release: every copy is checked */
        if (v.len > d.len - off) {
            PyBuffer_Release(&v);
            fail = 2;
            break;
        }
        if (nogil) {  /* called from a worker thread: the loop runs while this copies */
            Py_BEGIN_ALLOW_THREADS
            memcpy((char *)d.buf + off, v.buf, (size_t)v.len);
            Py_END_ALLOW_THREADS
        } else {
            memcpy((char *)d.buf + off, v.buf, (size_t)v.len);
        }
        Py_ssize_t size = v.len;
        PyBuffer_Release(&v);
        if (i >= PyList_GET_SIZE(at)) { fail = 2; break; }
        PyObject *where = PyLong_FromSsize_t(off);
        if (where == NULL || PyList_SetItem(at, i, where) < 0) { fail = 1; break; }
        off += (size + mask) & ~mask;
    }
    PyBuffer_Release(&d);
done:
    Py_DECREF(blobs);
    if (fail == 2) PyErr_SetString(PyExc_ValueError, "place_blobs: the blobs changed");
    if (fail) return NULL;
    return Py_BuildValue("nn", end, copied);
}

/* check_batch(ids, frame, totals, uids_of, total_out, uids_out) -> the largest uid, -1
 * (not served here: an id outside ``totals``, an episode that cannot serve the keymap
 * (its total -1), a frame outside [0, total)) or -2 (every sample is servable but an
 * episode has no uid in ``uids_of`` yet, or an id is outside it). Per sample i:
 *   total_out[i] = totals[ids[i]]      (the episode's frames; -1 where it cannot serve)
 *   uids_out[i] = uids_of[ids[i]]      (its cache uid) */
static PyObject *check_batch(PyObject *self, PyObject *args) {
    PyObject *o[6];
    if (!PyArg_ParseTuple(args, "OOOOOO", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5]))
        return NULL;
    static const int w[6] = {0, 0, 0, 0, 1, 1};
    I64 b[6];
    if (get_all(o, b, w, 6) < 0) return NULL;
    int64_t n = b[0].n, nt = b[2].n, nu = b[3].n, top = -1, missing = 0, got = -1;
    if (b[1].n != n || b[4].n < n || b[5].n < n) {
        release(b, 6);
        PyErr_SetString(PyExc_ValueError, "check_batch: buffers do not match the batch");
        return NULL;
    }
    for (int64_t i = 0; i < n; i++) {
        int64_t d = b[0].p[i], f = b[1].p[i];
        if (d < 0 || d >= nt) goto done;
        int64_t t = b[2].p[d];
        if (t < 0 || f < 0 || f >= t) goto done;
        b[4].p[i] = t;
        int64_t u = d < nu ? b[3].p[d] : -1;
        b[5].p[i] = u;
        if (u < 0) missing = 1;
        else if (u > top) top = u;
    }
    got = missing ? -2 : top;
done:
    release(b, 6);
    return PyLong_FromLongLong(got);
}

/* The loop of stamp (above) over one part: -1 if a slot is outside, else the count. */
static int64_t stamp_part(int64_t *st, int64_t ns, const int64_t *slots, int64_t n,
                          int64_t clock) {
    int64_t count = 0;
    for (int64_t i = 0; i < n; i++)
        if (slots[i] < 0 || slots[i] >= ns) return -1;
    for (int64_t i = 0; i < n; i++) {
        int64_t s = slots[i];
        if (st[s] != clock) { st[s] = clock; count++; }
    }
    return count;
}

/* stamp_keys(keys, clock) -> what ``stamp`` counts, summed, for each (stamps, parts, _) of
 * the tuple ``keys`` in turn, the k-th stamped ``clock + k``; -1 (that key's part and the
 * rest not stamped) if a slot lies outside its ``stamps``. */
static PyObject *stamp_keys(PyObject *self, PyObject *args) {
    PyObject *keys;
    long long clock;
    if (!PyArg_ParseTuple(args, "O!L", &PyTuple_Type, &keys, &clock)) return NULL;
    int64_t total = 0;
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(keys) && total >= 0; k++) {
        PyObject *item = PyTuple_GET_ITEM(keys, k), *parts;
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) < 2) {
            PyErr_SetString(PyExc_TypeError, "stamp_keys: a key is (stamps, parts, ...)");
            return NULL;
        }
        I64 st;
        if (get_i64(PyTuple_GET_ITEM(item, 0), &st, 1) < 0) return NULL;
        parts = PySequence_Fast(PyTuple_GET_ITEM(item, 1), "stamp_keys: parts are a sequence");
        if (parts == NULL) { PyBuffer_Release(&st.view); return NULL; }
        for (Py_ssize_t j = 0; j < PySequence_Fast_GET_SIZE(parts); j++) {
            I64 part;
            if (get_i64(PySequence_Fast_GET_ITEM(parts, j), &part, 0) < 0) {
                Py_DECREF(parts);
                PyBuffer_Release(&st.view);
                return NULL;
            }
            int64_t got = stamp_part(st.p, st.n, part.p, part.n, clock + k);
            PyBuffer_Release(&part.view);
            if (got < 0) { total = -1; break; }
            total += got;
        }
        Py_DECREF(parts);
        PyBuffer_Release(&st.view);
    }
    return PyLong_FromLongLong(total);
}

/* gather_rows(outs, srcs, idx, n, spec) -> None: every numeric output of a batch in one
 * call. ``spec`` is a tuple with one (src, idx_at, units, row_bytes) per output of the list
 * ``outs``: output k is rows idx[idx_at * n : (idx_at + units) * n] of the buffer
 * srcs[src] viewed as rows of row_bytes, in order, each index clipped into [0, rows) as
 * numpy's ``take(mode="clip")`` clips it; outs[k] (a writable contiguous buffer) must be
 * exactly units * n rows. Runs of consecutive rows are copied as one block. With ``nogil``
 * (called from a worker thread) the copies are made without the GIL. */
static PyObject *gather_rows(PyObject *self, PyObject *args) {
    PyObject *outs_l, *srcs, *idx_o, *spec;
    Py_ssize_t n;
    int nogil = 0;
    if (!PyArg_ParseTuple(args, "O!O!OnO!|p", &PyList_Type, &outs_l, &PyTuple_Type, &srcs,
                          &idx_o, &n, &PyTuple_Type, &spec, &nogil))
        return NULL;
    Py_ssize_t m = PyTuple_GET_SIZE(spec), ns = PyTuple_GET_SIZE(srcs);
    if (PyList_GET_SIZE(outs_l) != m || n < 0 || n > (1 << 30)) {
        PyErr_SetString(PyExc_ValueError, "gather_rows: bad arguments");
        return NULL;
    }
    /* the outputs as they are now (parsing a spec entry may run Python code) */
    PyObject *outs = PyList_AsTuple(outs_l);
    if (outs == NULL) return NULL;
    I64 idx;
    if (get_i64(idx_o, &idx, 0) < 0) { Py_DECREF(outs); return NULL; }
    int fail = 0;
    for (Py_ssize_t k = 0; k < m && !fail; k++) {
        Py_ssize_t src, at, units, rb;
        PyObject *entry = PyTuple_GET_ITEM(spec, k);
        if (!PyTuple_Check(entry) || !PyArg_ParseTuple(entry, "nnnn", &src, &at, &units, &rb)) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError, "gather_rows: an output is a tuple");
            fail = 1;
            break;
        }
        if (src < 0 || src >= ns || at < 0 || at > (1 << 30) || units < 0 || units > (1 << 30)
            || rb <= 0 || rb > (1 << 30) || (at + units) * (int64_t)n > idx.n) {
            PyErr_SetString(PyExc_ValueError, "gather_rows: an output does not fit");
            fail = 1;
            break;
        }
        Py_buffer sv, ov;
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(srcs, src), &sv, PyBUF_C_CONTIGUOUS) < 0) {
            fail = 1;
            break;
        }
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(outs, k), &ov,
                               PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
            PyBuffer_Release(&sv);
            fail = 1;
            break;
        }
        int64_t count = units * (int64_t)n, rows = sv.len / rb;
        if (ov.len % rb || ov.len / rb != count || (count && rows == 0)) {
            PyErr_SetString(PyExc_ValueError, count && rows == 0
                            ? "gather_rows: rows taken from an empty source"
                            : "gather_rows: an output's size does not match");
            fail = 1;
        }
        const char *s = (const char *)sv.buf;
        char *o = (char *)ov.buf;
        const int64_t *r = idx.p + at * (int64_t)n;
        /* called from a worker thread (a large gather), the copy is made without the GIL
         * so that the event loop runs meanwhile: only the buffers held here are touched */
        PyThreadState *ts = !fail && nogil ? PyEval_SaveThread() : NULL;
        for (int64_t i = 0; i < count && !fail;) {
            int64_t first = r[i] < 0 ? 0 : (r[i] >= rows ? rows - 1 : r[i]), last = first, j;
            for (j = i + 1; j < count && r[j] == last + 1 && r[j] < rows; j++) last = r[j];
            memcpy(o + i * rb, s + first * rb, (size_t)((j - i) * rb));
            i = j;
        }
        if (ts != NULL) PyEval_RestoreThread(ts);
        PyBuffer_Release(&ov);
        PyBuffer_Release(&sv);
    }
    PyBuffer_Release(&idx.view);
    Py_DECREF(outs);
    if (fail) return NULL;
    Py_RETURN_NONE;
}

/* inside(blobs, base, used) -> list: per blob of the list ``blobs``, its offset from the
 * buffer ``base`` when it lies wholly within base's first ``used`` bytes (an array the
 * planner gathered into the answer's segment), else None (bytes objects, such as cached
 * frames, and every blob elsewhere, to be copied). An empty blob is None. */
static PyObject *inside(PyObject *self, PyObject *args) {
    PyObject *blobs_l, *base_o;
    Py_ssize_t used;
    if (!PyArg_ParseTuple(args, "O!On", &PyList_Type, &blobs_l, &base_o, &used)) return NULL;
    Py_buffer bv;
    if (PyObject_GetBuffer(base_o, &bv, PyBUF_SIMPLE) < 0) return NULL;
    if (used < 0 || used > bv.len) used = used < 0 ? 0 : bv.len;
    uintptr_t lo = (uintptr_t)bv.buf;
    PyObject *blobs = PyList_AsTuple(blobs_l);  /* as they are now */
    Py_ssize_t n = blobs == NULL ? 0 : PyTuple_GET_SIZE(blobs);
    PyObject *out = blobs == NULL ? NULL : PyList_New(n);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        PyObject *b = PyTuple_GET_ITEM(blobs, i), *got = Py_None;
        if (!PyBytes_CheckExact(b)) {
            Py_buffer v;
            if (PyObject_GetBuffer(b, &v, PyBUF_C_CONTIGUOUS) < 0) {
                Py_CLEAR(out);
                break;
            }
            uintptr_t p = (uintptr_t)v.buf;
            if (v.len > 0 && p >= lo && p - lo <= (uintptr_t)(used - v.len) && v.len <= used) {
                got = PyLong_FromSsize_t((Py_ssize_t)(p - lo));
                if (got == NULL) {
                    PyBuffer_Release(&v);
                    Py_CLEAR(out);
                    break;
                }
            } else {
                Py_INCREF(got);
            }
            PyBuffer_Release(&v);
        } else {
            Py_INCREF(got);
        }
        PyList_SET_ITEM(out, i, got);
    }
    Py_XDECREF(blobs);
    PyBuffer_Release(&bv);
    return out;
}

/* varints(values) -> bytes: the protobuf varints of an int64 buffer, concatenated (a
 * packed repeated int field's body); a negative value takes ten bytes, as protobuf writes
 * an int64. */
static PyObject *varints(PyObject *self, PyObject *args) {
    PyObject *o;
    if (!PyArg_ParseTuple(args, "O", &o)) return NULL;
    I64 v;
    if (get_i64(o, &v, 0) < 0) return NULL;
    if (v.n > PY_SSIZE_T_MAX / 10) {
        PyBuffer_Release(&v.view);
        PyErr_SetString(PyExc_OverflowError, "varints: too many values");
        return NULL;
    }
    Py_ssize_t size = 0;
    for (int64_t i = 0; i < v.n; i++) {
        uint64_t x = (uint64_t)v.p[i];
        size++;
        while (x >= 0x80) { x >>= 7; size++; }
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, size);
    if (out != NULL) {
        unsigned char *w = (unsigned char *)PyBytes_AS_STRING(out);
        for (int64_t i = 0; i < v.n; i++) {
            uint64_t x = (uint64_t)v.p[i];
            while (x >= 0x80) { *w++ = (unsigned char)(x | 0x80); x >>= 7; }
            *w++ = (unsigned char)x;
        }
    }
    PyBuffer_Release(&v.view);
    return out;
}

static PyMethodDef methods[] = {
    {"key_base", key_base, METH_VARARGS, "per sample, its episode's table start and size"},
    {"resolve", resolve, METH_VARARGS, "slots and gather rows of one output"},
    {"horizon", horizon, METH_VARARGS, "rows and mask of a horizon window"},
    {"history", history, METH_VARARGS, "rows and mask of a history window"},
    {"stamp", stamp, METH_VARARGS, "stamp slots, count the distinct ones"},
    {"plan_keys", plan_keys, METH_VARARGS, "key_base and resolve for every numeric key"},
    {"stamp_keys", stamp_keys, METH_VARARGS, "stamp each key's slots with its own tick"},
    {"check_batch", check_batch, METH_VARARGS, "a batch's totals and uids, or why not"},
    {"place_blobs", place_blobs, METH_VARARGS, "lay out and copy an answer's blobs"},
    {"gather_rows", gather_rows, METH_VARARGS, "every numeric output of a batch"},
    {"inside", inside, METH_VARARGS, "which blobs lie in a buffer already, and where"},
    {"varints", varints, METH_VARARGS, "the varints of an int64 buffer"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_kernel", "The warm read path's inner loops.", -1, methods,
};

PyMODINIT_FUNC PyInit__kernel(void) { return PyModule_Create(&module); }

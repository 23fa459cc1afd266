/* shmhb._native: the board's hot paths in C (see shmhb/board/native.py, which picks the path).
 *
 *   Beater      hb.beat(): CLOCK_MONOTONIC (or an injected clock) and one release store
 *               of the packed heartbeat word, in one C call.
 *   SlotReader  board.slot(key): two acquire loads, the clock, and the cached SlotStatus
 *               when the words and the clock unit are what the previous call saw; else
 *               shmhb_judge_local() and a new SlotStatus.
 *   Words       acquire loads of single words for Board.changes(), the reaper's
 *               staleness check, and WordMemo (the memo of board.remote()).
 *   judge_local_array(...)  a whole snapshot() judged in one pass, into arrays the
 *               caller made (its numpy twin takes a dozen whole-array operations).
 *
 * Every object holds a buffer export of the board's mapping, so the mapping cannot go
 * away under it (mmap.close() refuses while exports exist; Segment.close tolerates
 * that); release() gives the export back.  Word indices are bounds-checked when an
 * object is built or when they enter from Python, and the mapping's alignment (64) is
 * checked once, so every load and store is a single aligned 8-byte access.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <time.h>

#include "include/shmhb.h"

/* --- shared helpers ------------------------------------------------------------------ */

static int get_map(PyObject *obj, Py_buffer *view, int writable) {
    if (PyObject_GetBuffer(obj, view, writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0)
        return -1;
    if (((uintptr_t)view->buf) % SHMHB_ALIGN != 0) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_ValueError, "board mapping is not cache-line aligned");
        return -1;
    }
    return 0;
}

static int check_word(const Py_buffer *view, Py_ssize_t i) {
    if (i < 0 || i >= view->len / 8) {
        PyErr_Format(PyExc_IndexError, "word %zd is outside the board (%zd words)", i,
                     view->len / 8);
        return -1;
    }
    return 0;
}

static inline uint64_t *word_at(const Py_buffer *view, Py_ssize_t i) {
    return (uint64_t *)view->buf + i;
}

/* Now in nanoseconds: CLOCK_MONOTONIC (clock NULL) or the injected Python clock. */
static inline int clock_ns(PyObject *clock, uint64_t *out) {
    if (clock == NULL) {
        struct timespec ts;
        if (clock_gettime(CLOCK_MONOTONIC, &ts) != 0) {
            PyErr_SetFromErrno(PyExc_OSError);
            return -1;
        }
        *out = (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
        return 0;
    }
    PyObject *r = PyObject_CallNoArgs(clock);
    if (r == NULL) return -1;
    *out = PyLong_AsUnsignedLongLong(r);
    Py_DECREF(r);
    return (*out == (uint64_t)-1 && PyErr_Occurred()) ? -1 : 0;
}

/* None (or time.monotonic_ns itself) means CLOCK_MONOTONIC, read in C. */
static PyObject *monotonic_ns_builtin = NULL;

static PyObject *clock_arg(PyObject *clock) {
    if (clock == Py_None || clock == monotonic_ns_builtin) return NULL;
    Py_INCREF(clock);
    return clock;
}

static int as_index(PyObject *o, Py_ssize_t *out) {
    *out = PyLong_AsSsize_t(o);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

/* --- Beater -------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    Py_buffer view;
    int held;
    uint64_t *word;
    uint64_t base;
    PyObject *clock;
    PyObject *closed_type, *closed_msg; /* what beat() raises once released (or NULL) */
} Beater;

static PyObject *Beater_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf,
                                   PyObject *kwnames) {
    Beater *b = (Beater *)self;
    uint64_t ns;
    (void)args;
    if (PyVectorcall_NARGS(nargsf) != 0 || (kwnames && PyTuple_GET_SIZE(kwnames))) {
        PyErr_SetString(PyExc_TypeError, "beat() takes no arguments");
        return NULL;
    }
    if (!b->held) {
        /* released: the heartbeat closed, or this is a forked child's copy (a bound
         * beat taken before fork() must not keep the parent's slot alive) */
        if (b->closed_type != NULL)
            PyErr_SetObject(b->closed_type, b->closed_msg);
        else
            PyErr_SetString(PyExc_ValueError, "this beat was released (the heartbeat is closed)");
        return NULL;
    }
    if (clock_ns(b->clock, &ns) < 0) return NULL;
    /* The one store of the hot path: release, so anything this process wrote before
     * (its registration record) is visible to a reader that acquires this word. */
    shmhb_store(b->word, b->base | (ns >> SHMHB_TS_SHIFT));
    Py_RETURN_NONE;
}

static PyObject *Beater_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"buffer", "word_index", "base", "clock", NULL};
    PyObject *buf, *clock = Py_None;
    Py_ssize_t i;
    unsigned long long base;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OnK|O:Beater", kwlist, &buf, &i, &base, &clock))
        return NULL;
    Beater *b = (Beater *)type->tp_alloc(type, 0);
    if (b == NULL) return NULL;
    b->vectorcall = Beater_vectorcall;
    if (get_map(buf, &b->view, 1) < 0) {
        Py_DECREF(b);
        return NULL;
    }
    b->held = 1;
    if (check_word(&b->view, i) < 0) {
        Py_DECREF(b);
        return NULL;
    }
    b->word = word_at(&b->view, i);
    b->base = base;
    b->clock = clock_arg(clock);
    return (PyObject *)b;
}

static void Beater_drop(Beater *b) {
    if (b->held) {
        b->held = 0;
        PyBuffer_Release(&b->view);
    }
}

/* release(error=None, message=None): give the mapping back; beat() then raises
 * error(message) (ValueError without one).  Every bound beat() shares this object, so
 * this invalidates them all: held is the flag the hot path tests already. */
static PyObject *Beater_release(Beater *b, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"error", "message", NULL};
    PyObject *err = Py_None, *msg = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|OO:release", kwlist, &err, &msg))
        return NULL;
    if (err != Py_None) {
        if (!PyExceptionClass_Check(err)) {
            PyErr_SetString(PyExc_TypeError, "error must be an exception class");
            return NULL;
        }
        Py_INCREF(err);
        Py_XSETREF(b->closed_type, err);
        Py_INCREF(msg);
        Py_XSETREF(b->closed_msg, msg);
    }
    Beater_drop(b);
    Py_RETURN_NONE;
}

static int Beater_traverse(Beater *b, visitproc visit, void *arg) {
    Py_VISIT(b->clock);
    Py_VISIT(b->closed_type);
    Py_VISIT(b->closed_msg);
    return 0;
}

static int Beater_clear(Beater *b) {
    Py_CLEAR(b->clock);
    Py_CLEAR(b->closed_type);
    Py_CLEAR(b->closed_msg);
    return 0;
}

static void Beater_dealloc(Beater *b) {
    PyObject_GC_UnTrack(b);
    Beater_drop(b);
    Beater_clear(b);
    Py_TYPE(b)->tp_free((PyObject *)b);
}

/* The same as calling the Beater, as a METH_FASTCALL method: CPython 3.11 specialises
 * a call of such a bound builtin to a direct C call (no vectorcall dispatch). */
static PyObject *Beater_beat(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return Beater_vectorcall(self, args, (size_t)nargs, NULL);
}

static PyMethodDef Beater_methods[] = {
    {"beat", (PyCFunction)(void (*)(void))Beater_beat, METH_FASTCALL,
     "beat(): clock read and one release store of the heartbeat word."},
    {"release", (PyCFunction)(void (*)(void))Beater_release, METH_VARARGS | METH_KEYWORDS,
     "release(error=None, message=None): give the mapping back; beat() then raises "
     "error(message)."},
    {NULL}};

static PyTypeObject BeaterType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmhb._native.Beater",
    .tp_basicsize = sizeof(Beater),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "Beater(buffer, word_index, base, clock=None): calling it stores "
              "base | (now_ns >> 20) into the word with release ordering.",
    .tp_new = Beater_new,
    .tp_dealloc = (destructor)Beater_dealloc,
    .tp_traverse = (traverseproc)Beater_traverse,
    .tp_clear = (inquiry)Beater_clear,
    .tp_vectorcall_offset = offsetof(Beater, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_methods = Beater_methods,
};

/* --- SlotReader and its per-key memo -------------------------------------------------- */

/* The slots of a Board._by_key entry, a list: shmhb/board/localreads.py's MEMO_*, which these
 * mirror (tests/test_native.py checks that they agree). */
#define SHMHB_MEMO_WI 0     /* the index of the slot's heartbeat word (its verdict follows) */
#define SHMHB_MEMO_TAG 1    /* the incarnation tag the entry was made for */
#define SHMHB_MEMO_PID 2
#define SHMHB_MEMO_INC 3    /* the incarnation */
#define SHMHB_MEMO_EPS 4    /* the endpoints */
#define SHMHB_MEMO_ANSWER 5 /* Python's (hb, verdict, now, answer), or our Memo */
#define SHMHB_MEMO_SLOTS 6

/* The memo of one Board._by_key entry: its words, and the answer for (hb, v, now). */
typedef struct {
    PyObject_HEAD
    Py_ssize_t wi;
    uint64_t tag, hb, v, now;
    PyObject *answer;
} Memo;

static void Memo_dealloc(Memo *m) {
    Py_XDECREF(m->answer);
    Py_TYPE(m)->tp_free((PyObject *)m);
}

static PyTypeObject MemoType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmhb._native.Memo",
    .tp_basicsize = sizeof(Memo),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The native memo of one key of Board._by_key (internal).",
    .tp_dealloc = (destructor)Memo_dealloc,
};

typedef struct {
    PyObject_HEAD
    Py_buffer view;
    int held;
    PyObject *by_key, *fallback, *statuses, *slot_type, *clock;
    uint64_t suspect, dead;
    double unit_s;
    int fast_alloc;
} SlotReader;

static PyObject *SlotReader_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"buffer", "by_key", "fallback", "suspect", "dead", "statuses",
                             "slot_type", "unit_s", "clock", NULL};
    PyObject *buf, *by_key, *fallback, *statuses, *slot_type, *clock = Py_None;
    unsigned long long suspect, dead;
    double unit_s;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO!OKKO!O!d|O:SlotReader", kwlist, &buf,
                                     &PyDict_Type, &by_key, &fallback, &suspect, &dead,
                                     &PyTuple_Type, &statuses, &PyType_Type, &slot_type,
                                     &unit_s, &clock))
        return NULL;
    if (PyTuple_GET_SIZE(statuses) != 6) {
        PyErr_SetString(PyExc_ValueError, "statuses: one Status per code 0..5");
        return NULL;
    }
    SlotReader *r = (SlotReader *)type->tp_alloc(type, 0);
    if (r == NULL) return NULL;
    if (get_map(buf, &r->view, 0) < 0) {
        Py_DECREF(r);
        return NULL;
    }
    r->held = 1;
    Py_INCREF(by_key); r->by_key = by_key;
    Py_INCREF(fallback); r->fallback = fallback;
    Py_INCREF(statuses); r->statuses = statuses;
    Py_INCREF(slot_type); r->slot_type = slot_type;
    r->clock = clock_arg(clock);
    r->suspect = suspect;
    r->dead = dead;
    r->unit_s = unit_s;
    /* A NamedTuple is a tuple subtype with no storage of its own: its instances can be
     * allocated and filled as tuple_subtype_new does, without its Python __new__. */
    PyTypeObject *st = (PyTypeObject *)slot_type;
    r->fast_alloc = PyType_IsSubtype(st, &PyTuple_Type) &&
                    st->tp_basicsize == PyTuple_Type.tp_basicsize &&
                    st->tp_itemsize == PyTuple_Type.tp_itemsize && st->tp_dictoffset == 0;
    return (PyObject *)r;
}

/* SlotStatus has 7 fields: the 6 a local read fills, and beat_age_s, which only a
 * remote read sets (None here, its default on the Python path). */
static PyObject *new_slot_status(SlotReader *r, PyObject *const items[6]) {
    if (r->fast_alloc) {
        PyTypeObject *st = (PyTypeObject *)r->slot_type;
        PyObject *t = st->tp_alloc(st, 7);
        if (t == NULL) return NULL;
        for (int k = 0; k < 6; k++) {
            Py_INCREF(items[k]);
            PyTuple_SET_ITEM(t, k, items[k]);
        }
        Py_INCREF(Py_None);
        PyTuple_SET_ITEM(t, 6, Py_None);
        return t;
    }
    return PyObject_Vectorcall(r->slot_type, items, 6, NULL);
}

/* Board.slot(key) with the entry Board._slot_slow makes (its slots: SHMHB_MEMO_*). */
static PyObject *SlotReader_slot(SlotReader *r, PyObject *key) {
    PyObject *entry, *result = NULL;
    Memo *memo;
    uint64_t hb, v, now, age;
    if (!r->held) goto slow;
    entry = PyDict_GetItemWithError(r->by_key, key);
    if (entry == NULL) {
        if (PyErr_Occurred()) return NULL;
        goto slow;
    }
    if (!PyList_CheckExact(entry) || PyList_GET_SIZE(entry) != SHMHB_MEMO_SLOTS) goto slow;
    Py_INCREF(entry);
    PyObject *m = PyList_GET_ITEM(entry, SHMHB_MEMO_ANSWER);
    if (Py_TYPE(m) == &MemoType) {
        memo = (Memo *)m;
        Py_INCREF(memo);
    } else { /* a fresh entry: give it a native memo */
        Py_ssize_t wi;
        uint64_t tag;
        if (as_index(PyList_GET_ITEM(entry, SHMHB_MEMO_WI), &wi) < 0 ||
            check_word(&r->view, wi + 1) < 0 ||
            check_word(&r->view, wi) < 0) {
            Py_DECREF(entry);
            return NULL;
        }
        tag = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(entry, SHMHB_MEMO_TAG));
        if (tag == (uint64_t)-1 && PyErr_Occurred()) {
            Py_DECREF(entry);
            return NULL;
        }
        memo = PyObject_New(Memo, &MemoType);
        if (memo == NULL) {
            Py_DECREF(entry);
            return NULL;
        }
        memo->wi = wi;
        memo->tag = tag;
        memo->hb = memo->v = memo->now = 0;
        memo->answer = NULL;
        Py_INCREF(memo);
        PyList_SetItem(entry, SHMHB_MEMO_ANSWER, (PyObject *)memo); /* steals one reference */
    }
    hb = shmhb_load(word_at(&r->view, memo->wi));
    v = shmhb_load(word_at(&r->view, memo->wi + 1));
    if (clock_ns(r->clock, &now) < 0) goto done;
    now >>= SHMHB_TS_SHIFT;
    if (memo->answer != NULL && hb == memo->hb && v == memo->v && now == memo->now) {
        result = memo->answer; /* judging is a pure function of (hb, v, now) */
        Py_INCREF(result);
        goto done;
    }
    if ((hb >> SHMHB_INC_SHIFT) != memo->tag) { /* another incarnation holds the slot */
        Py_DECREF(memo);
        Py_DECREF(entry);
        goto slow;
    }
    {
        int code = shmhb_judge_local(hb, v, now, r->suspect, r->dead, &age);
        PyObject *age_s = PyFloat_FromDouble((double)age * r->unit_s);
        if (age_s == NULL) goto done;
        PyObject *items[6] = {key, PyList_GET_ITEM(entry, SHMHB_MEMO_PID),
                              PyList_GET_ITEM(entry, SHMHB_MEMO_INC),
                              PyTuple_GET_ITEM(r->statuses, code), age_s,
                              PyList_GET_ITEM(entry, SHMHB_MEMO_EPS)};
        result = new_slot_status(r, items);
        Py_DECREF(age_s);
        if (result == NULL) goto done;
        PyObject *old = memo->answer;
        Py_INCREF(result);
        memo->answer = result;
        memo->hb = hb;
        memo->v = v;
        memo->now = now;
        Py_XDECREF(old);
    }
done:
    Py_DECREF(memo);
    Py_DECREF(entry);
    return result;
slow:
    return PyObject_CallOneArg(r->fallback, key);
}

/* Board.status(key): the status of slot(key), or None. */
static PyObject *SlotReader_status(SlotReader *r, PyObject *key) {
    PyObject *s = SlotReader_slot(r, key), *st;
    if (s == NULL || s == Py_None) return s;
    if (!PyTuple_Check(s) || PyTuple_GET_SIZE(s) != 6) { /* a fallback's odd answer */
        st = PyObject_GetAttrString(s, "status");
    } else {
        st = PyTuple_GET_ITEM(s, 3);
        Py_INCREF(st);
    }
    Py_DECREF(s);
    return st;
}

static PyObject *SlotReader_release(SlotReader *r, PyObject *unused) {
    (void)unused;
    if (r->held) {
        r->held = 0;
        PyBuffer_Release(&r->view);
    }
    Py_RETURN_NONE;
}

static int SlotReader_traverse(SlotReader *r, visitproc visit, void *arg) {
    Py_VISIT(r->by_key);
    Py_VISIT(r->fallback);
    Py_VISIT(r->statuses);
    Py_VISIT(r->slot_type);
    Py_VISIT(r->clock);
    return 0;
}

static int SlotReader_clear(SlotReader *r) {
    Py_CLEAR(r->by_key);
    Py_CLEAR(r->fallback);
    Py_CLEAR(r->statuses);
    Py_CLEAR(r->slot_type);
    Py_CLEAR(r->clock);
    return 0;
}

static void SlotReader_dealloc(SlotReader *r) {
    PyObject_GC_UnTrack(r);
    SlotReader_release(r, NULL);
    SlotReader_clear(r);
    Py_TYPE(r)->tp_free((PyObject *)r);
}

static PyMethodDef SlotReader_methods[] = {
    {"slot", (PyCFunction)SlotReader_slot, METH_O, "Board.slot(key), natively."},
    {"status", (PyCFunction)SlotReader_status, METH_O, "Board.status(key), natively."},
    {"release", (PyCFunction)SlotReader_release, METH_NOARGS, "Give the mapping back."},
    {NULL}};

static PyTypeObject SlotReaderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmhb._native.SlotReader",
    .tp_basicsize = sizeof(SlotReader),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "SlotReader(buffer, by_key, fallback, suspect, dead, statuses, slot_type, "
              "unit_s, clock=None): Board.slot's hot path.",
    .tp_new = SlotReader_new,
    .tp_dealloc = (destructor)SlotReader_dealloc,
    .tp_traverse = (traverseproc)SlotReader_traverse,
    .tp_clear = (inquiry)SlotReader_clear,
    .tp_methods = SlotReader_methods,
};

/* --- Words and WordMemo --------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    Py_buffer view;
    int held;
    PyObject *clock;
    Py_ssize_t gen_a, gen_b, hb0, nslots;
} Words;

static PyObject *Words_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"buffer", "gen_a", "gen_b", "hb0", "nslots", "clock", NULL};
    PyObject *buf, *clock = Py_None;
    Py_ssize_t a, b, hb0, nslots;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "Onnnn|O:Words", kwlist, &buf, &a, &b, &hb0,
                                     &nslots, &clock))
        return NULL;
    Words *w = (Words *)type->tp_alloc(type, 0);
    if (w == NULL) return NULL;
    if (get_map(buf, &w->view, 0) < 0) {
        Py_DECREF(w);
        return NULL;
    }
    w->held = 1;
    if (check_word(&w->view, a) < 0 || check_word(&w->view, b) < 0 || nslots < 0 ||
        (nslots && check_word(&w->view, hb0 + 8 * (nslots - 1) + 1) < 0) || hb0 < 0) {
        Py_DECREF(w);
        return NULL;
    }
    w->gen_a = a;
    w->gen_b = b;
    w->hb0 = hb0;
    w->nslots = nslots;
    w->clock = clock_arg(clock);
    return (PyObject *)w;
}

static int words_held(Words *w) {
    if (!w->held) {
        PyErr_SetString(PyExc_ValueError, "the board is closed");
        return 0;
    }
    return 1;
}

static PyObject *Words_load(Words *w, PyObject *arg) {
    Py_ssize_t i;
    if (!words_held(w) || as_index(arg, &i) < 0 || check_word(&w->view, i) < 0) return NULL;
    return PyLong_FromUnsignedLongLong(shmhb_load(word_at(&w->view, i)));
}

static PyObject *Words_changes(Words *w, PyObject *unused) {
    (void)unused;
    if (!words_held(w)) return NULL;
    /* two counters, each moving forward on its own: their sum changes when either does */
    return PyLong_FromUnsignedLongLong(shmhb_load(word_at(&w->view, w->gen_a)) +
                                       shmhb_load(word_at(&w->view, w->gen_b)));
}

/* now - (oldest heartbeat ts among the given slot indices), in units (may be < 0). */
static PyObject *Words_oldest_age(Words *w, PyObject *idx) {
    Py_buffer ib;
    uint64_t now, oldest = UINT64_MAX;
    if (!words_held(w)) return NULL;
    if (PyObject_GetBuffer(idx, &ib, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return NULL;
    const char *f = ib.format ? ib.format : "B";
    if (*f == '<' || *f == '=' || *f == '@') f++;
    if (ib.itemsize != 8 || !(strcmp(f, "l") == 0 || strcmp(f, "q") == 0 || strcmp(f, "n") == 0)) {
        PyBuffer_Release(&ib);
        PyErr_SetString(PyExc_TypeError, "slot indices: a contiguous int64/intp array");
        return NULL;
    }
    Py_ssize_t n = ib.len / 8;
    const int64_t *ix = (const int64_t *)ib.buf;
    for (Py_ssize_t k = 0; k < n; k++) {
        if (ix[k] < 0 || ix[k] >= w->nslots) {
            PyBuffer_Release(&ib);
            PyErr_Format(PyExc_IndexError, "slot %lld is outside the board", (long long)ix[k]);
            return NULL;
        }
        uint64_t ts = shmhb_load(word_at(&w->view, w->hb0 + 8 * (Py_ssize_t)ix[k])) & SHMHB_TS39_MASK;
        if (ts < oldest) oldest = ts;
    }
    PyBuffer_Release(&ib);
    if (n == 0) Py_RETURN_NONE;
    if (clock_ns(w->clock, &now) < 0) return NULL;
    now >>= SHMHB_TS_SHIFT;
    return PyLong_FromLongLong((long long)now - (long long)oldest);
}

static PyObject *Words_release(Words *w, PyObject *unused) {
    (void)unused;
    if (w->held) {
        w->held = 0;
        PyBuffer_Release(&w->view);
    }
    Py_RETURN_NONE;
}

static PyObject *Words_memo(Words *w, PyObject *args);

static int Words_traverse(Words *w, visitproc visit, void *arg) {
    Py_VISIT(w->clock);
    return 0;
}

static int Words_clear(Words *w) {
    Py_CLEAR(w->clock);
    return 0;
}

static void Words_dealloc(Words *w) {
    PyObject_GC_UnTrack(w);
    Words_release(w, NULL);
    Words_clear(w);
    Py_TYPE(w)->tp_free((PyObject *)w);
}

static PyMethodDef Words_methods[] = {
    {"load", (PyCFunction)Words_load, METH_O, "load(i): acquire load of word i."},
    {"changes", (PyCFunction)Words_changes, METH_NOARGS, "Board.changes(), natively."},
    {"oldest_age", (PyCFunction)Words_oldest_age, METH_O,
     "oldest_age(slot_indices): now minus the oldest heartbeat ts, in units; None if empty."},
    {"memo", (PyCFunction)Words_memo, METH_VARARGS,
     "memo(i, j, k): a WordMemo over three words."},
    {"release", (PyCFunction)Words_release, METH_NOARGS, "Give the mapping back."},
    {NULL}};

static PyTypeObject WordsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmhb._native.Words",
    .tp_basicsize = sizeof(Words),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Words(buffer, gen_a, gen_b, hb0, nslots, clock=None): single-word loads.",
    .tp_new = Words_new,
    .tp_dealloc = (destructor)Words_dealloc,
    .tp_traverse = (traverseproc)Words_traverse,
    .tp_clear = (inquiry)Words_clear,
    .tp_methods = Words_methods,
};

/* The answer for three words and a clock unit.  get(now) returns it while the words
 * (acquire-loaded) and now are what it was stored for, else None, remembering what it
 * saw and for which thread.  put(now, answer) stores it only for the thread that saw
 * the miss, and only if the words still read what that get() saw: the answer was then
 * computed from those very words (each word is self-describing; nothing else of a row
 * can change without its word changing). */
typedef struct {
    PyObject_HEAD
    Words *words;
    Py_ssize_t ix[3];
    uint64_t key[4], seen[4];
    unsigned long seen_thread;
    int valid;
    PyObject *answer;
} WordMemo;

static PyTypeObject WordMemoType;

static PyObject *Words_memo(Words *w, PyObject *args) {
    Py_ssize_t i, j, k;
    if (!PyArg_ParseTuple(args, "nnn:memo", &i, &j, &k)) return NULL;
    if (!words_held(w) || check_word(&w->view, i) < 0 || check_word(&w->view, j) < 0 ||
        check_word(&w->view, k) < 0)
        return NULL;
    WordMemo *m = PyObject_GC_New(WordMemo, &WordMemoType);
    if (m == NULL) return NULL;
    Py_INCREF(w);
    m->words = w;
    m->ix[0] = i;
    m->ix[1] = j;
    m->ix[2] = k;
    m->valid = 0;
    m->seen_thread = 0;
    m->answer = NULL;
    memset(m->key, 0, sizeof m->key);
    memset(m->seen, 0, sizeof m->seen);
    PyObject_GC_Track(m);
    return (PyObject *)m;
}

static int memo_load(WordMemo *m, uint64_t now, uint64_t out[4]) {
    if (!m->words->held) return 0;
    for (int k = 0; k < 3; k++) out[k] = shmhb_load(word_at(&m->words->view, m->ix[k]));
    out[3] = now;
    return 1;
}

static int memo_now(PyObject *arg, uint64_t *now) {
    *now = PyLong_AsUnsignedLongLong(arg);
    return (*now == (uint64_t)-1 && PyErr_Occurred()) ? -1 : 0;
}

static PyObject *WordMemo_get(WordMemo *m, PyObject *arg) {
    uint64_t now, w[4];
    if (memo_now(arg, &now) < 0) return NULL;
    if (!memo_load(m, now, w)) Py_RETURN_NONE;
    if (m->valid && memcmp(w, m->key, sizeof w) == 0) {
        Py_INCREF(m->answer);
        return m->answer;
    }
    memcpy(m->seen, w, sizeof w);
    m->seen_thread = PyThread_get_thread_ident();
    Py_RETURN_NONE;
}

static PyObject *WordMemo_put(WordMemo *m, PyObject *args) {
    PyObject *nowo, *answer;
    uint64_t now, w[4];
    if (!PyArg_ParseTuple(args, "OO:put", &nowo, &answer) || memo_now(nowo, &now) < 0)
        return NULL;
    if (answer != Py_None && memo_load(m, now, w) &&
        m->seen_thread == PyThread_get_thread_ident() && memcmp(w, m->seen, sizeof w) == 0) {
        PyObject *old = m->answer;
        Py_INCREF(answer);
        m->answer = answer;
        memcpy(m->key, w, sizeof w);
        m->valid = 1;
        Py_XDECREF(old);
    }
    m->seen_thread = 0;
    Py_INCREF(answer);
    return answer;
}

static int WordMemo_traverse(WordMemo *m, visitproc visit, void *arg) {
    Py_VISIT(m->words);
    Py_VISIT(m->answer);
    return 0;
}

static int WordMemo_clear(WordMemo *m) {
    m->valid = 0;
    Py_CLEAR(m->answer);
    Py_CLEAR(m->words);
    return 0;
}

static void WordMemo_dealloc(WordMemo *m) {
    PyObject_GC_UnTrack(m);
    WordMemo_clear(m);
    PyObject_GC_Del(m);
}

static int memo_words_ok(WordMemo *m) { return m->words != NULL; }

static PyObject *WordMemo_get_checked(WordMemo *m, PyObject *arg) {
    if (!memo_words_ok(m)) Py_RETURN_NONE;
    return WordMemo_get(m, arg);
}

static PyObject *WordMemo_put_checked(WordMemo *m, PyObject *args) {
    if (!memo_words_ok(m)) {
        PyObject *nowo, *answer;
        if (!PyArg_ParseTuple(args, "OO:put", &nowo, &answer)) return NULL;
        Py_INCREF(answer);
        return answer;
    }
    return WordMemo_put(m, args);
}

static PyMethodDef WordMemo_methods[] = {
    {"get", (PyCFunction)WordMemo_get_checked, METH_O, "get(now): the stored answer, or None."},
    {"put", (PyCFunction)WordMemo_put_checked, METH_VARARGS, "put(now, answer): returns answer."},
    {NULL}};

static PyTypeObject WordMemoType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmhb._native.WordMemo",
    .tp_basicsize = sizeof(WordMemo),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The answer memoised for three board words and a clock unit (Words.memo).",
    .tp_dealloc = (destructor)WordMemo_dealloc,
    .tp_traverse = (traverseproc)WordMemo_traverse,
    .tp_clear = (inquiry)WordMemo_clear,
    .tp_methods = WordMemo_methods,
};

/* --- judging, exposed for the tests (same words judged alike on both paths) ---------- */

static PyObject *py_judge_local(PyObject *mod, PyObject *args) {
    unsigned long long hb, v, now, suspect, dead;
    uint64_t age;
    (void)mod;
    if (!PyArg_ParseTuple(args, "KKKKK:judge_local", &hb, &v, &now, &suspect, &dead)) return NULL;
    int code = shmhb_judge_local(hb, v, now, suspect, dead, &age);
    return Py_BuildValue("iK", code, (unsigned long long)age);
}

static PyObject *py_judge_row(PyObject *mod, PyObject *args) {
    unsigned long long word, gen, now;
    int ok;
    uint64_t age;
    (void)mod;
    if (!PyArg_ParseTuple(args, "KKpK:judge_row", &word, &gen, &ok, &now)) return NULL;
    int code = shmhb_judge_row(word, gen, ok, now, &age);
    if (code < 0) Py_RETURN_NONE;
    return Py_BuildValue("iK", code, (unsigned long long)age);
}

static PyObject *py_agent_fresh(PyObject *mod, PyObject *args) {
    unsigned long long hb, now, stale;
    (void)mod;
    if (!PyArg_ParseTuple(args, "KKK:agent_fresh", &hb, &now, &stale)) return NULL;
    return PyBool_FromLong(shmhb_agent_fresh(hb, now, stale));
}

static PyObject *py_combine_remote(PyObject *mod, PyObject *args) {
    int reported, host;
    (void)mod;
    if (!PyArg_ParseTuple(args, "ii:combine_remote", &reported, &host)) return NULL;
    return PyLong_FromLong(shmhb_combine_remote(reported, host));
}

/* --- judging a whole board's words (judge.judge_local_array) ------------------------- */

/* A 1-D C-contiguous buffer of n items of `size` bytes with an unsigned integer format
 * (numpy's uint64 exports "L" on LP64, a memoryview "Q"; uint8 "B"). */
static int get_array(PyObject *obj, Py_buffer *view, int writable, Py_ssize_t size,
                     const char *what) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0) return -1;
    const char *f = view->format ? view->format : "B";
    if (*f == '@' || *f == '=') f++;
    int ok = view->ndim == 1 && view->itemsize == size && f[1] == '\0' &&
             (size == 1 ? *f == 'B' : (*f == 'L' || *f == 'Q'));
    if (!ok) {
        PyErr_Format(PyExc_ValueError, "%s: pass a 1-D array of %s", what,
                     size == 1 ? "uint8" : "uint64");
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* judge_local_array(hb, verdict, codes, ages, now, suspect, dead): shmhb_judge_local()
 * for every slot, writing each slot's status code (0 for an empty slot: hb == 0) into
 * codes and its age in units into ages.  The words are the caller's copies (snapshot()),
 * so nothing here is shared memory. */
static PyObject *py_judge_local_array(PyObject *mod, PyObject *args) {
    PyObject *o[4];
    unsigned long long now, suspect, dead;
    Py_buffer b[4];
    static const char *what[4] = {"hb", "verdict", "codes", "ages"};
    static const Py_ssize_t size[4] = {8, 8, 1, 8};
    int k;
    (void)mod;
    if (!PyArg_ParseTuple(args, "OOOOKKK:judge_local_array", &o[0], &o[1], &o[2], &o[3],
                          &now, &suspect, &dead))
        return NULL;
    for (k = 0; k < 4; k++) {
        if (get_array(o[k], &b[k], k >= 2, size[k], what[k]) < 0) {
            while (k--) PyBuffer_Release(&b[k]);
            return NULL;
        }
    }
    Py_ssize_t n = b[0].shape[0];
    if (b[1].shape[0] != n || b[2].shape[0] != n || b[3].shape[0] != n) {
        for (k = 0; k < 4; k++) PyBuffer_Release(&b[k]);
        PyErr_SetString(PyExc_ValueError, "judge_local_array: arrays of unequal length");
        return NULL;
    }
    const uint64_t *hb = b[0].buf, *v = b[1].buf;
    uint8_t *codes = b[2].buf;
    uint64_t *ages = b[3].buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t w = hb[i], age;
        int code = shmhb_judge_local(w, v[i], now, suspect, dead, &age);
        codes[i] = w == 0 ? 0 : (uint8_t)code;
        ages[i] = age;
    }
    for (k = 0; k < 4; k++) PyBuffer_Release(&b[k]);
    Py_RETURN_NONE;
}

static PyObject *py_record_checksum(PyObject *mod, PyObject *arg) {
    Py_buffer b;
    (void)mod;
    if (PyObject_GetBuffer(arg, &b, PyBUF_SIMPLE) < 0) return NULL;
    if (b.len != SHMHB_REC_BYTES) {
        PyBuffer_Release(&b);
        PyErr_SetString(PyExc_ValueError, "a slot record is 384 bytes");
        return NULL;
    }
    uint64_t ck = shmhb_record_checksum((const char *)b.buf);
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLongLong(ck);
}

static PyMethodDef module_methods[] = {
    {"judge_local", py_judge_local, METH_VARARGS,
     "judge_local(hb, verdict, now, suspect, dead) -> (code, age): shmhb.h's rule."},
    {"judge_row", py_judge_row, METH_VARARGS,
     "judge_row(word, gen, agent_ok, now) -> (code, age) or None: shmhb.h's rule."},
    {"agent_fresh", py_agent_fresh, METH_VARARGS, "agent_fresh(agent_hb, now, stale)."},
    {"combine_remote", py_combine_remote, METH_VARARGS, "combine_remote(reported, host)."},
    {"judge_local_array", py_judge_local_array, METH_VARARGS,
     "judge_local_array(hb, verdict, codes, ages, now, suspect, dead): each slot's code "
     "(0: empty) and age, into codes (uint8) and ages (uint64)."},
    {"record_checksum", py_record_checksum, METH_O, "record_checksum(384 bytes)."},
    {NULL}};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "shmhb._native",
    "The board's hot paths in C; see shmhb.native.", -1, module_methods,
};

PyMODINIT_FUNC PyInit__native(void) {
    PyObject *m, *time_mod;
    if (PyType_Ready(&BeaterType) < 0 || PyType_Ready(&MemoType) < 0 ||
        PyType_Ready(&SlotReaderType) < 0 || PyType_Ready(&WordsType) < 0 ||
        PyType_Ready(&WordMemoType) < 0)
        return NULL;
    time_mod = PyImport_ImportModule("time");
    if (time_mod == NULL) return NULL;
    monotonic_ns_builtin = PyObject_GetAttrString(time_mod, "monotonic_ns");
    Py_DECREF(time_mod);
    if (monotonic_ns_builtin == NULL) return NULL;
    m = PyModule_Create(&moduledef);
    if (m == NULL) return NULL;
    Py_INCREF(&BeaterType);
    Py_INCREF(&SlotReaderType);
    Py_INCREF(&WordsType);
    if (PyModule_AddObject(m, "Beater", (PyObject *)&BeaterType) < 0 ||
        PyModule_AddObject(m, "SlotReader", (PyObject *)&SlotReaderType) < 0 ||
        PyModule_AddObject(m, "Words", (PyObject *)&WordsType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

/* shmhb._fence: the go-ahead's consumer side in C, so that a producer's ask is answered
 * without this process's GIL (see shmhb/kv/grants.py, which picks the path, and
 * shmhb/kv/fence.py, which documents the wire and mirrors this decoder in Python).
 *
 *   GrantTable  the state of each load (WAITING, GRANTED, ABANDONED), keyed by the
 *               16-byte token of the producer it was asked of and the request id, under
 *               one pthread mutex; a load granted over the wire also holds when its
 *               lease ends (CLOCK_MONOTONIC ns: the moment its ask was read, plus the
 *               table's lease, which every reply carries; shmhb/kv/grants.py argues
 *               the lease).  Python starts, abandons, grants (a pull's local
 *               go-ahead) and ends loads; the server thread grants.  The mutex makes a
 *               grant and an abandon of one load exclude each other: exactly one moves
 *               it out of WAITING (the fence's one rule, shmhb/kv/loads.py).  That
 *               is a lock, not a lock-free word, on purpose: this is not a hot path of
 *               the board, a grant looks up to 1024 loads at once, and a mutex's
 *               acquire/release order is what makes it right on aarch64 as on x86.
 *   GrantServer one pthread, one poll() over a listening TCP socket, its connections and
 *               a wake pipe.  It never touches a Python object, so it never waits for
 *               the GIL.  Frames are 4-byte big-endian lengths and bodies (1 to
 *               MAX_FRAME bytes); an ask is decoded and checked in full before any
 *               load is looked at, and anything malformed closes its connection and is
 *               counted.  At most max_connections are kept (the least recently active
 *               goes); a buffer grows to one frame at most.
 *   send_nowait, recv_nowait, wait_readable
 *               the producer's non-blocking send and receive, and a wait of a few
 *               milliseconds at most, made while holding the GIL: a socket call from
 *               Python drops the GIL around the syscall, and on a busy engine the thread
 *               waits up to a switch interval (5 ms) to get it back.  A non-blocking
 *               call takes microseconds; the wait is for a reply due in a round trip.
 *
 * Counters are written by the server thread only and read with relaxed atomic loads
 * (aligned 64-bit words: never torn).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define VERSION 1
#define KIND_ASK 1
#define KIND_REPLY 2
#define MAX_FRAME 65536u
#define MAX_REQS 1024u
#define MAX_ID 256u
#define TOKEN 16u
#define ASK_HEAD 36u   /* version, kind, count(2), nonce(8), incarnation(8), token(16) */
#define REPLY_HEAD 16u /* version, kind, count(2), nonce(8), lease_ms(4) */
#define MAX_REPLY (4u + REPLY_HEAD + MAX_REQS)
#define MAX_KEY (TOKEN + MAX_ID)
#define PAUSE_MS 100 /* how long accept() rests when no descriptor is left */

enum { WAITING = 0, GRANTED = 1, ABANDONED = 2 };

static inline uint16_t be16(const uint8_t *p) { return (uint16_t)((p[0] << 8) | p[1]); }
static inline uint32_t be32(const uint8_t *p) {
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}
static inline uint64_t be64(const uint8_t *p) {
    return ((uint64_t)be32(p) << 32) | be32(p + 4);
}
static inline void put16(uint8_t *p, uint16_t v) { p[0] = (uint8_t)(v >> 8); p[1] = (uint8_t)v; }
static inline void put32(uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)(v >> 24); p[1] = (uint8_t)(v >> 16); p[2] = (uint8_t)(v >> 8); p[3] = (uint8_t)v;
}
static inline void put64(uint8_t *p, uint64_t v) { put32(p, (uint32_t)(v >> 32)); put32(p + 4, (uint32_t)v); }

/* --- SipHash-2-4: request ids come from clients, so the table's hash is keyed --------- */

#define ROTL(x, b) (uint64_t)(((x) << (b)) | ((x) >> (64 - (b))))
#define SIPROUND                                                                   \
    do {                                                                           \
        v0 += v1; v1 = ROTL(v1, 13); v1 ^= v0; v0 = ROTL(v0, 32);                   \
        v2 += v3; v3 = ROTL(v3, 16); v3 ^= v2;                                     \
        v0 += v3; v3 = ROTL(v3, 21); v3 ^= v0;                                     \
        v2 += v1; v1 = ROTL(v1, 17); v1 ^= v2; v2 = ROTL(v2, 32);                   \
    } while (0)

static uint64_t le64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

static uint64_t siphash(const uint8_t *in, size_t n, uint64_t k0, uint64_t k1) {
    uint64_t v0 = 0x736f6d6570736575ULL ^ k0, v1 = 0x646f72616e646f6dULL ^ k1;
    uint64_t v2 = 0x6c7967656e657261ULL ^ k0, v3 = 0x7465646279746573ULL ^ k1;
    uint64_t b = ((uint64_t)n) << 56, m;
    size_t i, end = n - (n % 8);
    for (i = 0; i < end; i += 8) {
        m = le64(in + i);
        v3 ^= m; SIPROUND; SIPROUND; v0 ^= m;
    }
    for (size_t j = 0; j < n % 8; j++) b |= ((uint64_t)in[end + j]) << (8 * j);
    v3 ^= b; SIPROUND; SIPROUND; v0 ^= b;
    v2 ^= 0xff; SIPROUND; SIPROUND; SIPROUND; SIPROUND;
    return v0 ^ v1 ^ v2 ^ v3;
}

/* --- GrantTable -------------------------------------------------------------------- */

typedef struct entry {
    struct entry *next;
    uint64_t hash;
    uint64_t until_ns; /* granted over the wire: when its lease ends (0: no lease) */
    uint16_t klen;
    uint8_t state;
    uint8_t key[]; /* token, then the request id */
} entry;

typedef struct {
    PyObject_HEAD
    pthread_mutex_t mu;
    entry **buckets;
    size_t nbuckets; /* a power of two */
    size_t n;
    uint64_t k0, k1;
    uint32_t lease_ms; /* what a grant over the wire promises (set once, at init) */
} GrantTable;

/* Constant time over the key's length: the token part is a capability. */
static int key_eq(const entry *e, const uint8_t *key, size_t klen) {
    if (e->klen != klen) return 0;
    uint8_t d = 0;
    for (size_t i = 0; i < klen; i++) d |= (uint8_t)(e->key[i] ^ key[i]);
    return d == 0;
}

/* The entry's link in its bucket, or where it would go; the mutex is held. */
static entry **find(GrantTable *t, const uint8_t *key, size_t klen, uint64_t h) {
    entry **pp = &t->buckets[h & (t->nbuckets - 1)];
    while (*pp != NULL && !((*pp)->hash == h && key_eq(*pp, key, klen))) pp = &(*pp)->next;
    return pp;
}

static int grow(GrantTable *t) {
    size_t nb = t->nbuckets * 2;
    entry **b = calloc(nb, sizeof(entry *));
    if (b == NULL) return -1;
    for (size_t i = 0; i < t->nbuckets; i++) {
        entry *e = t->buckets[i];
        while (e != NULL) {
            entry *next = e->next;
            entry **slot = &b[e->hash & (nb - 1)];
            e->next = *slot;
            *slot = e;
            e = next;
        }
    }
    free(t->buckets);
    t->buckets = b;
    t->nbuckets = nb;
    return 0;
}

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* WAITING -> to, for one load; the mutex is held.  1 if it moved.  until_ns: when the
 * lease of a grant over the wire ends (0: a move without a lease). */
static int move_locked(GrantTable *t, const uint8_t *key, size_t klen, uint8_t to,
                       uint64_t until_ns) {
    uint64_t h = siphash(key, klen, t->k0, t->k1);
    entry *e = *find(t, key, klen, h);
    if (e == NULL || e->state != WAITING) return 0;
    e->state = to;
    e->until_ns = until_ns;
    return 1;
}

static int table_init(GrantTable *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"seed", "lease_ms", NULL};
    Py_buffer seed;
    unsigned long lease_ms;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "y*k:GrantTable", names, &seed, &lease_ms))
        return -1;
    if (seed.len != 16 || lease_ms == 0 || lease_ms > UINT32_MAX) {
        PyBuffer_Release(&seed);
        PyErr_SetString(PyExc_ValueError, "GrantTable: the seed is 16 random bytes, the "
                        "lease 1 to 2**32 - 1 ms");
        return -1;
    }
    if (self->buckets != NULL) { /* __init__ twice: keep the loads and their hash */
        PyBuffer_Release(&seed);
        return 0;
    }
    self->lease_ms = (uint32_t)lease_ms;
    self->k0 = le64(seed.buf);
    self->k1 = le64((const uint8_t *)seed.buf + 8);
    PyBuffer_Release(&seed);
    self->buckets = calloc(64, sizeof(entry *));
    if (self->buckets == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    self->nbuckets = 64;
    self->n = 0;
    return 0;
}

static PyObject *table_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    (void)args; (void)kw;
    GrantTable *self = (GrantTable *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    pthread_mutex_init(&self->mu, NULL);
    return (PyObject *)self;
}

static void table_dealloc(GrantTable *self) {
    if (self->buckets != NULL) {
        for (size_t i = 0; i < self->nbuckets; i++) {
            entry *e = self->buckets[i];
            while (e != NULL) {
                entry *next = e->next;
                free(e);
                e = next;
            }
        }
        free(self->buckets);
    }
    pthread_mutex_destroy(&self->mu);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int get_key(GrantTable *self, PyObject *arg, Py_buffer *key) {
    if (self->buckets == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "GrantTable: not initialised");
        return -1;
    }
    if (PyObject_GetBuffer(arg, key, PyBUF_SIMPLE) < 0) return -1;
    if (key->len <= (Py_ssize_t)TOKEN || key->len > (Py_ssize_t)MAX_KEY) {
        PyBuffer_Release(key);
        PyErr_Format(PyExc_ValueError, "a load's key is a %u-byte token and an id of 1 to %u "
                     "bytes, not %zd bytes", TOKEN, MAX_ID, key->len);
        return -1;
    }
    return 0;
}

static PyObject *table_start(GrantTable *self, PyObject *arg) {
    Py_buffer key;
    if (get_key(self, arg, &key) < 0) return NULL;
    uint64_t h = siphash(key.buf, (size_t)key.len, self->k0, self->k1);
    entry *fresh = malloc(sizeof(entry) + (size_t)key.len);
    if (fresh == NULL) {
        PyBuffer_Release(&key);
        return PyErr_NoMemory();
    }
    pthread_mutex_lock(&self->mu);
    entry **pp = find(self, key.buf, (size_t)key.len, h);
    if (*pp != NULL) { /* the same load started again: WAITING anew */
        (*pp)->state = WAITING;
        (*pp)->until_ns = 0;
        free(fresh);
    } else {
        fresh->next = NULL;
        fresh->hash = h;
        fresh->klen = (uint16_t)key.len;
        fresh->state = WAITING;
        fresh->until_ns = 0;
        memcpy(fresh->key, key.buf, (size_t)key.len);
        *pp = fresh;
        self->n++;
        if (self->n > self->nbuckets * 3 / 4) (void)grow(self); /* no room: longer chains */
    }
    pthread_mutex_unlock(&self->mu);
    PyBuffer_Release(&key);
    Py_RETURN_NONE;
}

static PyObject *table_move(GrantTable *self, PyObject *arg, uint8_t to) {
    Py_buffer key;
    if (get_key(self, arg, &key) < 0) return NULL;
    pthread_mutex_lock(&self->mu);
    int moved = move_locked(self, key.buf, (size_t)key.len, to, 0); /* local: no lease */
    pthread_mutex_unlock(&self->mu);
    PyBuffer_Release(&key);
    return PyBool_FromLong(moved);
}

static PyObject *table_grant(GrantTable *self, PyObject *arg) { return table_move(self, arg, GRANTED); }
static PyObject *table_abandon(GrantTable *self, PyObject *arg) { return table_move(self, arg, ABANDONED); }

/* state(key) -> 0/1/2, or -1 when absent; end(key) -> (that state, when its lease
 * ends: 0 for none), and the load is removed. */
static PyObject *table_look(GrantTable *self, PyObject *arg, int remove) {
    Py_buffer key;
    if (get_key(self, arg, &key) < 0) return NULL;
    uint64_t h = siphash(key.buf, (size_t)key.len, self->k0, self->k1);
    long state = -1;
    uint64_t until_ns = 0;
    entry *gone = NULL;
    pthread_mutex_lock(&self->mu);
    entry **pp = find(self, key.buf, (size_t)key.len, h);
    if (*pp != NULL) {
        state = (*pp)->state;
        until_ns = (*pp)->until_ns;
        if (remove) {
            gone = *pp;
            *pp = gone->next;
            self->n--;
        }
    }
    pthread_mutex_unlock(&self->mu);
    free(gone);
    PyBuffer_Release(&key);
    if (remove) return Py_BuildValue("(lK)", state, (unsigned long long)until_ns);
    return PyLong_FromLong(state);
}

static PyObject *table_state(GrantTable *self, PyObject *arg) { return table_look(self, arg, 0); }
static PyObject *table_end(GrantTable *self, PyObject *arg) { return table_look(self, arg, 1); }

static Py_ssize_t table_len(GrantTable *self) {
    pthread_mutex_lock(&self->mu);
    Py_ssize_t n = (Py_ssize_t)self->n;
    pthread_mutex_unlock(&self->mu);
    return n;
}

/* The reply to one ask body (without its length), or -1 for a malformed one.  Nothing
 * is looked up before the whole frame is checked.  *granted: loads it granted;
 * *stale: 1 when the ask named another incarnation (nothing granted).  Each grant's
 * lease runs from now: the ask was sent before it was read, so the producer's own
 * count (from its send) ends no later than this one (shmhb/kv/grants.py). */
static int answer(GrantTable *t, uint64_t incarnation, const uint8_t *f, size_t n,
                  uint8_t *out, size_t *outlen, unsigned *granted, int *stale) {
    *granted = 0;
    *stale = 0;
    if (n < ASK_HEAD || n > MAX_FRAME || f[0] != VERSION || f[1] != KIND_ASK) return -1;
    unsigned count = be16(f + 2);
    if (count == 0 || count > MAX_REQS) return -1;
    size_t p = ASK_HEAD;
    for (unsigned i = 0; i < count; i++) {
        if (p + 2 > n) return -1;
        unsigned len = be16(f + p);
        if (len == 0 || len > MAX_ID || p + 2 + len > n) return -1;
        p += 2 + len;
    }
    if (p != n) return -1;
    out[0] = VERSION;
    out[1] = KIND_REPLY;
    put16(out + 2, (uint16_t)count);
    memcpy(out + 4, f + 4, 8); /* the nonce */
    put32(out + 12, t->lease_ms);
    memset(out + REPLY_HEAD, 0, count);
    *outlen = REPLY_HEAD + count;
    if (be64(f + 12) != incarnation) {
        *stale = 1;
        return 0;
    }
    uint8_t key[MAX_KEY];
    memcpy(key, f + 20, TOKEN);
    p = ASK_HEAD;
    uint64_t until_ns = now_ns() + (uint64_t)t->lease_ms * 1000000u;
    pthread_mutex_lock(&t->mu);
    for (unsigned i = 0; i < count; i++) {
        unsigned len = be16(f + p);
        memcpy(key + TOKEN, f + p + 2, len);
        if (move_locked(t, key, TOKEN + len, GRANTED, until_ns)) {
            out[REPLY_HEAD + i] = 1;
            (*granted)++;
        }
        p += 2 + len;
    }
    pthread_mutex_unlock(&t->mu);
    return 0;
}

/* answer(incarnation, body) -> reply body, or None when malformed: what the server
 * thread sends, for tests that hold the C decoder to the Python one. */
static PyObject *table_answer(GrantTable *self, PyObject *args) {
    unsigned long long inc;
    Py_buffer f;
    uint8_t out[MAX_REPLY];
    size_t outlen = 0;
    unsigned granted;
    int stale, r;
    if (!PyArg_ParseTuple(args, "Ky*:answer", &inc, &f)) return NULL;
    if (self->buckets == NULL) {
        PyBuffer_Release(&f);
        PyErr_SetString(PyExc_RuntimeError, "GrantTable: not initialised");
        return NULL;
    }
    r = answer(self, inc, f.buf, (size_t)f.len, out, &outlen, &granted, &stale);
    PyBuffer_Release(&f);
    if (r < 0) Py_RETURN_NONE;
    return PyBytes_FromStringAndSize((const char *)out, (Py_ssize_t)outlen);
}

static PyMethodDef table_methods[] = {
    {"start", (PyCFunction)table_start, METH_O, "start(key): the load is WAITING."},
    {"grant", (PyCFunction)table_grant, METH_O, "grant(key) -> bool: WAITING -> GRANTED."},
    {"abandon", (PyCFunction)table_abandon, METH_O, "abandon(key) -> bool: WAITING -> ABANDONED."},
    {"state", (PyCFunction)table_state, METH_O, "state(key) -> 0/1/2, -1 when absent."},
    {"end", (PyCFunction)table_end, METH_O,
     "end(key) -> (its state (-1 absent), when its lease ends in ns (0: none)); removed."},
    {"answer", (PyCFunction)table_answer, METH_VARARGS, "answer(incarnation, body) -> reply or None."},
    {NULL}};

static PySequenceMethods table_seq = {.sq_length = (lenfunc)table_len};

static PyTypeObject GrantTableType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "shmhb._fence.GrantTable",
    .tp_basicsize = sizeof(GrantTable),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "GrantTable(seed, lease_ms): the loads' states, shared with a GrantServer's "
              "thread; a grant over the wire is promised for lease_ms.",
    .tp_new = table_new,
    .tp_init = (initproc)table_init,
    .tp_dealloc = (destructor)table_dealloc,
    .tp_methods = table_methods,
    .tp_as_sequence = &table_seq,
};

/* --- GrantServer -------------------------------------------------------------------- */

typedef struct {
    int fd;
    uint8_t *buf;
    uint32_t len, cap;
    uint64_t stamp; /* when it was last active, in the server's own count */
} conn_t;

typedef struct {
    PyObject_HEAD
    GrantTable *table; /* a reference: the table outlives the thread */
    int lfd;
    int wake[2];
    uint64_t incarnation; /* atomic: Python stores it once registered */
    int max_conns;
    conn_t *conns;
    int nconns;
    uint64_t clock;
    pthread_t thread;
    int running;
    /* counters: the thread writes, Python reads (relaxed atomics) */
    uint64_t asks, bad_frames, stale_asks, granted, dropped;
} GrantServer;

static inline void bump(uint64_t *c, uint64_t n) { __atomic_store_n(c, __atomic_load_n(c, __ATOMIC_RELAXED) + n, __ATOMIC_RELAXED); }

static void conn_close(GrantServer *s, int i) {
    close(s->conns[i].fd);
    free(s->conns[i].buf);
    s->conns[i].fd = -1;
    s->conns[i].buf = NULL;
}

static int oldest(GrantServer *s) {
    int o = -1;
    for (int i = 0; i < s->nconns; i++)
        if (s->conns[i].fd >= 0 && (o < 0 || s->conns[i].stamp < s->conns[o].stamp)) o = i;
    return o;
}

static void compact(GrantServer *s) {
    int j = 0;
    for (int i = 0; i < s->nconns; i++)
        if (s->conns[i].fd >= 0) s->conns[j++] = s->conns[i];
    s->nconns = j;
}

/* Frames on connection i answered; 0 when it stays open, -1 when it was closed. */
static int serve_frames(GrantServer *s, int i) {
    conn_t *c = &s->conns[i];
    uint32_t off = 0;
    while (c->len - off >= 4) {
        uint32_t n = be32(c->buf + off);
        if (n == 0 || n > MAX_FRAME) {
            bump(&s->bad_frames, 1);
            return -1;
        }
        if (c->len - off < 4 + n) break;
        uint8_t out[MAX_REPLY];
        size_t outlen;
        unsigned granted;
        int stale;
        uint64_t inc = __atomic_load_n(&s->incarnation, __ATOMIC_RELAXED);
        if (answer(s->table, inc, c->buf + off + 4, n, out + 4, &outlen, &granted, &stale) < 0) {
            bump(&s->bad_frames, 1);
            return -1;
        }
        bump(&s->asks, 1);
        if (stale) bump(&s->stale_asks, 1);
        if (granted) bump(&s->granted, granted);
        put32(out, (uint32_t)outlen);
        ssize_t sent = send(c->fd, out, outlen + 4, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (sent != (ssize_t)(outlen + 4)) return -1; /* a peer that does not read */
        off += 4 + n;
    }
    if (off) {
        memmove(c->buf, c->buf + off, c->len - off);
        c->len -= off;
    }
    return 0;
}

/* One read on connection i (level-triggered: what is left comes next round). */
static void on_readable(GrantServer *s, int i) {
    conn_t *c = &s->conns[i];
    uint32_t need = c->len >= 4 ? 4 + be32(c->buf) : 4;
    if (need > 4 + MAX_FRAME) need = 4 + MAX_FRAME; /* a bad length: found on parsing */
    if (need > c->cap || c->cap == c->len) {
        uint32_t cap = c->cap ? c->cap : 256;
        while (cap < need || cap == c->len) cap *= 2;
        if (cap > 4 + MAX_FRAME) cap = 4 + MAX_FRAME;
        uint8_t *b = realloc(c->buf, cap);
        if (b == NULL) {
            conn_close(s, i);
            return;
        }
        c->buf = b;
        c->cap = cap;
    }
    ssize_t r = recv(c->fd, c->buf + c->len, c->cap - c->len, 0);
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
    if (r <= 0) { /* the peer closed, or reset: what it sent before was answered */
        conn_close(s, i);
        return;
    }
    c->len += (uint32_t)r;
    c->stamp = ++s->clock;
    if (serve_frames(s, i) < 0) conn_close(s, i);
}

static uint64_t now_ms(void) { return now_ns() / 1000000u; }

/* Accepts what waits; 1 when no descriptor is left and nothing could be closed. */
static int on_acceptable(GrantServer *s) {
    for (int k = 0; k < 64; k++) {
        int fd = accept(s->lfd, NULL, NULL);
        if (fd < 0) {
            if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
                int o = oldest(s);
                if (o < 0) return 1;
                conn_close(s, o);
                bump(&s->dropped, 1);
                compact(s);
                continue;
            }
            return 0; /* EAGAIN, or a connection aborted before it was taken */
        }
        int one = 1, fl = fcntl(fd, F_GETFL);
        if (fl < 0 || fcntl(fd, F_SETFL, fl | O_NONBLOCK) < 0 ||
            fcntl(fd, F_SETFD, FD_CLOEXEC) < 0) {
            close(fd);
            continue;
        }
        (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        if (s->nconns >= s->max_conns) { /* idle peers cannot crowd a producer out */
            conn_close(s, oldest(s));
            bump(&s->dropped, 1);
            compact(s);
        }
        conn_t *c = &s->conns[s->nconns++];
        c->fd = fd;
        c->buf = NULL;
        c->len = c->cap = 0;
        c->stamp = ++s->clock;
    }
    return 0;
}

static void *serve(void *arg) {
    GrantServer *s = arg;
    struct pollfd *p = calloc((size_t)s->max_conns + 2, sizeof *p);
    uint64_t paused_until = 0;
    if (p == NULL) return NULL;
    for (;;) {
        int listening = now_ms() >= paused_until;
        p[0].fd = s->wake[0];
        p[0].events = POLLIN;
        p[1].fd = listening ? s->lfd : -1;
        p[1].events = POLLIN;
        for (int i = 0; i < s->nconns; i++) {
            p[2 + i].fd = s->conns[i].fd;
            p[2 + i].events = POLLIN;
            p[2 + i].revents = 0;
        }
        p[0].revents = p[1].revents = 0;
        int r = poll(p, (nfds_t)s->nconns + 2, listening ? -1 : PAUSE_MS);
        if (r < 0) {
            if (errno != EINTR) {
                struct timespec ts = {0, 10 * 1000 * 1000};
                nanosleep(&ts, NULL); /* ENOMEM: try again, never spin */
            }
            continue;
        }
        if (p[0].revents) break; /* close(): stop */
        int n = s->nconns;
        for (int i = 0; i < n; i++)
            if (p[2 + i].revents && s->conns[i].fd >= 0) on_readable(s, i);
        compact(s);
        if (listening && p[1].revents && on_acceptable(s)) paused_until = now_ms() + PAUSE_MS;
    }
    free(p);
    for (int i = 0; i < s->nconns; i++) conn_close(s, i);
    s->nconns = 0;
    return NULL;
}

static PyObject *server_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    (void)args; (void)kw;
    GrantServer *s = (GrantServer *)type->tp_alloc(type, 0);
    if (s != NULL) s->lfd = s->wake[0] = s->wake[1] = -1;
    return (PyObject *)s;
}

static int server_init(GrantServer *s, PyObject *args, PyObject *kw) {
    static char *names[] = {"table", "fd", "incarnation", "max_connections", NULL};
    PyObject *table;
    int fd, maxc;
    unsigned long long inc;
    if (s->running) {
        PyErr_SetString(PyExc_RuntimeError, "GrantServer: already serving");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O!iKi:GrantServer", names, &GrantTableType,
                                     &table, &fd, &inc, &maxc))
        return -1;
    if (((GrantTable *)table)->buckets == NULL || maxc < 1 || maxc > 65536) {
        PyErr_SetString(PyExc_ValueError, "GrantServer: an initialised table and 1 to 65536 "
                        "connections");
        return -1;
    }
    /* its own descriptor: the Python socket object may be closed independently */
    s->lfd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (s->lfd < 0 || pipe(s->wake) < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    int fl = fcntl(s->lfd, F_GETFL);
    if (fl < 0 || fcntl(s->lfd, F_SETFL, fl | O_NONBLOCK) < 0 ||
        fcntl(s->wake[0], F_SETFD, FD_CLOEXEC) < 0 || fcntl(s->wake[1], F_SETFD, FD_CLOEXEC) < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    s->conns = calloc((size_t)maxc, sizeof(conn_t));
    if (s->conns == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    Py_INCREF(table);
    s->table = (GrantTable *)table;
    s->incarnation = inc;
    s->max_conns = maxc;
    /* The thread starts with every signal a host handles blocked (it inherits the mask
     * in force at pthread_create, so there is no window): the kernel hands a signal sent
     * to the process to any thread that does not block it, and Python runs handlers in
     * the main thread only, so one handed to this thread would leave an engine's main
     * thread asleep in a wait with its SIGINT or SIGTERM pending (shmhb.periodic,
     * block_host_signals).  Faults stay deliverable to the thread that causes them. */
    sigset_t all, old;
    sigfillset(&all);
    sigdelset(&all, SIGSEGV);
    sigdelset(&all, SIGBUS);
    sigdelset(&all, SIGFPE);
    sigdelset(&all, SIGILL);
    sigdelset(&all, SIGTRAP);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    int err = pthread_create(&s->thread, NULL, serve, s);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (err != 0) {
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    s->running = 1;
    return 0;
}

static PyObject *server_close(GrantServer *s, PyObject *unused) {
    (void)unused;
    if (s->running) {
        char b = 1;
        ssize_t w;
        do w = write(s->wake[1], &b, 1); while (w < 0 && errno == EINTR);
        Py_BEGIN_ALLOW_THREADS
        pthread_join(s->thread, NULL);
        Py_END_ALLOW_THREADS
        s->running = 0;
    }
    for (int k = 0; k < 2; k++)
        if (s->wake[k] >= 0) { close(s->wake[k]); s->wake[k] = -1; }
    if (s->lfd >= 0) { close(s->lfd); s->lfd = -1; }
    Py_RETURN_NONE;
}

static void server_dealloc(GrantServer *s) {
    PyObject *r = server_close(s, NULL);
    Py_XDECREF(r);
    free(s->conns);
    Py_XDECREF(s->table);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

static PyObject *server_set_incarnation(GrantServer *s, PyObject *arg) {
    unsigned long long inc = PyLong_AsUnsignedLongLong(arg);
    if (inc == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    __atomic_store_n(&s->incarnation, (uint64_t)inc, __ATOMIC_RELAXED);
    Py_RETURN_NONE;
}

static PyObject *server_counters(GrantServer *s, PyObject *unused) {
    (void)unused;
    return Py_BuildValue("{sKsKsKsKsK}",
        "asks", (unsigned long long)__atomic_load_n(&s->asks, __ATOMIC_RELAXED),
        "bad_frames", (unsigned long long)__atomic_load_n(&s->bad_frames, __ATOMIC_RELAXED),
        "stale_asks", (unsigned long long)__atomic_load_n(&s->stale_asks, __ATOMIC_RELAXED),
        "granted", (unsigned long long)__atomic_load_n(&s->granted, __ATOMIC_RELAXED),
        "dropped", (unsigned long long)__atomic_load_n(&s->dropped, __ATOMIC_RELAXED));
}

static PyMethodDef server_methods[] = {
    {"close", (PyCFunction)server_close, METH_NOARGS, "Stop the thread (at once) and close."},
    {"set_incarnation", (PyCFunction)server_set_incarnation, METH_O, "Grant asks of this incarnation."},
    {"counters", (PyCFunction)server_counters, METH_NOARGS,
     "{asks, bad_frames, stale_asks, granted, dropped} so far."},
    {NULL}};

static PyTypeObject GrantServerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "shmhb._fence.GrantServer",
    .tp_basicsize = sizeof(GrantServer),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "GrantServer(table, fd, incarnation, max_connections): answers asks on the "
              "listening socket fd (duplicated) in a thread of its own.",
    .tp_new = server_new,
    .tp_init = (initproc)server_init,
    .tp_dealloc = (destructor)server_dealloc,
    .tp_methods = server_methods,
};

/* --- the producer's non-blocking socket calls, GIL held ----------------------------- */

static PyObject *send_nowait(PyObject *mod, PyObject *args) {
    int fd;
    Py_buffer b;
    (void)mod;
    if (!PyArg_ParseTuple(args, "iy*:send_nowait", &fd, &b)) return NULL;
    ssize_t n;
    do n = send(fd, b.buf, (size_t)b.len, MSG_DONTWAIT | MSG_NOSIGNAL); while (n < 0 && errno == EINTR);
    PyBuffer_Release(&b);
    if (n < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK) return PyLong_FromLong(0);
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromSsize_t(n);
}

static PyObject *recv_nowait(PyObject *mod, PyObject *args) {
    int fd;
    Py_ssize_t max;
    uint8_t buf[4096];
    (void)mod;
    if (!PyArg_ParseTuple(args, "in:recv_nowait", &fd, &max)) return NULL;
    if (max <= 0) return PyBytes_FromStringAndSize(NULL, 0);
    if (max > (Py_ssize_t)sizeof buf) max = sizeof buf;
    ssize_t n;
    do n = recv(fd, buf, (size_t)max, MSG_DONTWAIT); while (n < 0 && errno == EINTR);
    if (n < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK) Py_RETURN_NONE;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyBytes_FromStringAndSize((const char *)buf, n);
}

/* wait_readable(fd, timeout_ms) -> bool, without dropping the GIL: a bounded wait for a
 * reply due within microseconds, where dropping the GIL would cost getting it back. */
static PyObject *wait_readable(PyObject *mod, PyObject *args) {
    int fd, ms, r;
    (void)mod;
    if (!PyArg_ParseTuple(args, "ii:wait_readable", &fd, &ms)) return NULL;
    if (ms < 0 || ms > 10) {
        PyErr_SetString(PyExc_ValueError, "wait_readable: 0 to 10 ms (it holds the GIL)");
        return NULL;
    }
    struct pollfd p = {fd, POLLIN, 0};
    do r = poll(&p, 1, ms); while (r < 0 && errno == EINTR);
    if (r < 0) return PyErr_SetFromErrno(PyExc_OSError);
    return PyBool_FromLong(r > 0);
}

static PyMethodDef module_methods[] = {
    {"wait_readable", wait_readable, METH_VARARGS,
     "wait_readable(fd, timeout_ms <= 10) -> bool; the GIL is kept."},
    {"send_nowait", send_nowait, METH_VARARGS,
     "send_nowait(fd, data) -> bytes sent (0: the buffer is full); the GIL is kept."},
    {"recv_nowait", recv_nowait, METH_VARARGS,
     "recv_nowait(fd, max) -> bytes (b'': closed) or None (nothing yet); the GIL is kept."},
    {NULL}};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "shmhb._fence",
    "The go-ahead's grants in C, answered without the GIL; see shmhb.kv.grants.", -1,
    module_methods,
};

PyMODINIT_FUNC PyInit__fence(void) {
    if (PyType_Ready(&GrantTableType) < 0 || PyType_Ready(&GrantServerType) < 0) return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (m == NULL) return NULL;
    Py_INCREF(&GrantTableType);
    Py_INCREF(&GrantServerType);
    if (PyModule_AddObject(m, "GrantTable", (PyObject *)&GrantTableType) < 0 ||
        PyModule_AddObject(m, "GrantServer", (PyObject *)&GrantServerType) < 0 ||
        PyModule_AddIntConstant(m, "VERSION", VERSION) < 0 ||
        PyModule_AddIntConstant(m, "MAX_FRAME", MAX_FRAME) < 0 ||
        PyModule_AddIntConstant(m, "MAX_REQS", MAX_REQS) < 0 ||
        PyModule_AddIntConstant(m, "MAX_ID_BYTES", MAX_ID) < 0 ||
        PyModule_AddIntConstant(m, "TOKEN_BYTES", TOKEN) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

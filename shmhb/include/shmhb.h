/* shmhb.h: read (and beat into) a shmhb board from C, without Python.
 *
 * The byte map, the word packing and the judging rule of shmhb/board/layout.py,
 * shmhb/board/words.py and shmhb/board/judge.py, in C99 plus the GCC/Clang __atomic builtins.  Header-only; the
 * Python extension shmhb._native is built from it, and tests/test_native.py keeps every
 * #define below equal to layout.py (and compiles examples/board_status.c against it).
 * Find it with `python -c "import shmhb; print(shmhb.get_include())"`.
 *
 * Memory order.  Every word a reader judges is one aligned 64-bit word with one writer.
 * shmhb_load() is an acquire load and shmhb_store() a release store of such a word: on
 * x86-64 a plain MOV, on aarch64 LDAR/STLR; both single-copy atomic on an aligned
 * address, which shmhb_word() asserts.  Nothing needs ordering between two words: each
 * word names the incarnation (or row generation) it belongs to, and multi-word records
 * are validated by their checksum (shmhb_record_checksum), never trusted by position.
 *
 * Opening a board: shm_open("/" NAME, O_RDONLY), fstat, mmap(PROT_READ) the whole
 * size, then shmhb_header_ok().  Never ftruncate a board you did not create.
 */
#ifndef SHMHB_H
#define SHMHB_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <assert.h>

#ifdef __cplusplus
extern "C" {
#endif

/* --- byte map -------------------------------------------------------------------- */

#define SHMHB_MAGIC 0x01445242484d4853ULL /* "SHMHBRD\x01", little-endian */
#define SHMHB_LAYOUT_VERSION 1
#define SHMHB_HEADER_BYTES 4096
#define SHMHB_ALIGN 64
#define SHMHB_STATE_READY 0x5245414459ULL /* "READY" */

/* header fields: byte offsets (u32 fields: nslots..nwatch, version, header_bytes) */
#define SHMHB_HDR_MAGIC 0
#define SHMHB_HDR_VERSION 8
#define SHMHB_HDR_HEADER_BYTES 12
#define SHMHB_HDR_TOTAL_BYTES 16
#define SHMHB_HDR_NSLOTS 24
#define SHMHB_HDR_NPEERS 28
#define SHMHB_HDR_NREMOTE 32
#define SHMHB_HDR_NWATCH 36
#define SHMHB_HDR_SLOT_OFF 40
#define SHMHB_HDR_RECORD_OFF 48
#define SHMHB_HDR_PEER_OFF 56
#define SHMHB_HDR_REMOTE_OFF 64
#define SHMHB_HDR_WATCH_OFF 72
#define SHMHB_HDR_BOOT_ID 80
#define SHMHB_HDR_BOARD_INC 96
#define SHMHB_HDR_CREATED_NS 104
#define SHMHB_HDR_CREATOR_PID 112
#define SHMHB_HDR_SUSPECT_AFTER_NS 120
#define SHMHB_HDR_DEAD_AFTER_NS 128
#define SHMHB_HDR_AGENT_STALE_NS 136
#define SHMHB_HDR_PEER_SUSPECT_AFTER_NS 144
#define SHMHB_HDR_PEER_DEAD_AFTER_NS 152
#define SHMHB_HDR_STATE 160
#define SHMHB_HDR_FORGET_AFTER_NS 168   /* 0: off */
#define SHMHB_HDR_TIMENS_OFFSET_NS 176  /* creator's CLOCK_MONOTONIC offset (int64) */
#define SHMHB_HDR_INC_COUNTER 192
#define SHMHB_HDR_REG_GEN 200
#define SHMHB_HDR_AGENT_TERM 208
#define SHMHB_HDR_AGENT_HB 256
#define SHMHB_HDR_AGENT_ID 264
#define SHMHB_HDR_AGENT_GEN 272
#define SHMHB_HDR_AGENT_LATENESS_US 280
#define SHMHB_HDR_STATS 320
#define SHMHB_HDR_CFG_GEN 640
#define SHMHB_HDR_CFG_LISTEN 648
#define SHMHB_HDR_CFG_SECRET_PATH 712
#define SHMHB_HDR_CFG_CURVE_DIR 968
#define SHMHB_HDR_CFG_INTERVAL_NS 1224
#define SHMHB_HDR_CFG_CHECKSUM 1232
#define SHMHB_HDR_CFG_BUDGET_MPPS 1240
/* the agent's network half, written by the role holder (shmhb/net/state.py): judge by
 * NET_STATE alone; the other fields are details checksummed with it (NET_CK) */
#define SHMHB_HDR_NET_STATE 1280
#define SHMHB_HDR_NET_GEN 1288
#define SHMHB_HDR_NET_LISTEN 1296
#define SHMHB_HDR_NET_ERROR 1360
#define SHMHB_HDR_NET_CK 1616
/* the role holder's reservation of ping nonces and push seqs (shmhb/net/exchange.py) */
#define SHMHB_HDR_NET_COUNTER 2048

/* slot words: one 64-byte line per slot at slot_off + i * SHMHB_SLOT_BYTES */
#define SHMHB_SLOT_BYTES 64
#define SHMHB_SLOT_HB 0      /* written by the worker */
#define SHMHB_SLOT_VERDICT 8 /* written by the agent */

/* slot record at record_off + i * SHMHB_REC_BYTES (written under the registry lock) */
#define SHMHB_REC_BYTES 384
#define SHMHB_REC_INCARNATION 0
#define SHMHB_REC_PID 8
#define SHMHB_REC_PID_START 16
#define SHMHB_REC_PID_NS 24
#define SHMHB_REC_REGISTERED_NS 32
#define SHMHB_REC_KEY 40
#define SHMHB_REC_ENDPOINTS 104
#define SHMHB_REC_CHECKSUM 360

/* peer row at peer_off + i * SHMHB_PEER_BYTES (written by the agent) */
#define SHMHB_PEER_BYTES 192
#define SHMHB_PEER_STATUS 0
#define SHMHB_PEER_RTT 8
#define SHMHB_PEER_GEN 16
#define SHMHB_PEER_BOARD_INC 24
#define SHMHB_PEER_BOOT_ID 32
#define SHMHB_PEER_ADDRESS 48
#define SHMHB_PEER_CHECKSUM 112
#define SHMHB_PEER_AUTH 120 /* gen:20 | failing:1 | count:43: frames failing authentication */
#define SHMHB_PEER_CAPPED 128 /* gen:20 | count:44: workers its host listed that are not stored here */

/* remote row at remote_off + i * SHMHB_REMOTE_BYTES (written by the agent) */
#define SHMHB_REMOTE_BYTES 384
#define SHMHB_REMOTE_STATUS 0
#define SHMHB_REMOTE_GEN 8
#define SHMHB_REMOTE_PEER 16
#define SHMHB_REMOTE_PEER_GEN 24
#define SHMHB_REMOTE_INCARNATION 32
#define SHMHB_REMOTE_PID 40
#define SHMHB_REMOTE_KEY 48
#define SHMHB_REMOTE_ENDPOINTS 112
#define SHMHB_REMOTE_CHECKSUM 368
#define SHMHB_REMOTE_BEAT 376 /* gen:20 | 0 | ts:40: the worker's own last beat; 0: unknown */

/* watch row at watch_off + i * SHMHB_WATCH_BYTES */
#define SHMHB_WATCH_BYTES 128
#define SHMHB_WATCH_OWNER_PID 0
#define SHMHB_WATCH_OWNER_START 8
#define SHMHB_WATCH_REFS 16
#define SHMHB_WATCH_ADDRESS 24
#define SHMHB_WATCH_OWNER_NS 88
#define SHMHB_WATCH_CHECKSUM 120

/* fixed field sizes (strings are NUL padded) */
#define SHMHB_KEY_BYTES 64
#define SHMHB_ENDPOINTS_BYTES 256
#define SHMHB_ADDR_BYTES 64
#define SHMHB_PATH_BYTES 256
#define SHMHB_MAX_ENDPOINTS 8

/* --- word packing (bit 63 on the left) --------------------------------------------
 *   hb        | incarnation:24 | left:1 | ts:39 |
 *   verdict   | incarnation:24 | ts:40          |
 *   agent_hb  | term:24        | left:1 | ts:39 |
 *   row word  | gen:20 | code:4 | ts:40         |
 * ts: CLOCK_MONOTONIC nanoseconds >> SHMHB_TS_SHIFT (units of ~1.05 ms)
 */
#define SHMHB_TS_SHIFT 20
#define SHMHB_TS_UNIT_NS 1048576ULL
#define SHMHB_INC_BITS 24
#define SHMHB_INC_SHIFT 40
#define SHMHB_INC_MASK 0xffffffULL
#define SHMHB_LEFT_BIT 0x8000000000ULL
#define SHMHB_TS39_MASK 0x7fffffffffULL
#define SHMHB_TS40_MASK 0xffffffffffULL
#define SHMHB_GEN_BITS 20
#define SHMHB_GEN_SHIFT 44
#define SHMHB_GEN_MASK 0xfffffULL
#define SHMHB_CODE_SHIFT 40
#define SHMHB_CODE_MASK 0xfULL
#define SHMHB_RTT_MASK 0xfffffffffffULL

/* Status codes (shmhb.Status.code); 0 is "no slot" */
#define SHMHB_STATUS_ALIVE 1
#define SHMHB_STATUS_SUSPECT 2
#define SHMHB_STATUS_DEAD 3
#define SHMHB_STATUS_LEFT 4
#define SHMHB_STATUS_UNKNOWN 5

static inline const char *shmhb_status_name(int code) {
    switch (code) {
    case SHMHB_STATUS_ALIVE: return "alive";
    case SHMHB_STATUS_SUSPECT: return "suspect";
    case SHMHB_STATUS_DEAD: return "dead";
    case SHMHB_STATUS_LEFT: return "left";
    default: return "unknown";
    }
}

/* --- words ------------------------------------------------------------------------ */

/* The word at byte offset `off` of a mapping; the address must be 8-byte aligned. */
static inline uint64_t *shmhb_word(const void *base, size_t off) {
    uintptr_t p = (uintptr_t)base + off;
    assert(p % 8 == 0 && "shmhb words must be 8-byte aligned");
    return (uint64_t *)p;
}

static inline uint64_t shmhb_load(const uint64_t *p) {
    return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}

static inline void shmhb_store(uint64_t *p, uint64_t v) {
    __atomic_store_n(p, v, __ATOMIC_RELEASE);
}

/* Fields that never change after creation (read them once, plainly). */
static inline uint64_t shmhb_u64(const void *base, size_t off) {
    uint64_t v;
    memcpy(&v, (const char *)base + off, 8);
    return v;
}

static inline uint32_t shmhb_u32(const void *base, size_t off) {
    uint32_t v;
    memcpy(&v, (const char *)base + off, 4);
    return v;
}

/* 0 when the mapping of `len` bytes holds a finished board of this layout. */
static inline int shmhb_header_ok(const void *base, size_t len) {
    if (len < SHMHB_HEADER_BYTES || ((uintptr_t)base) % SHMHB_ALIGN) return -1;
    if (shmhb_u64(base, SHMHB_HDR_MAGIC) != SHMHB_MAGIC) return -2;
    if (shmhb_u32(base, SHMHB_HDR_VERSION) != SHMHB_LAYOUT_VERSION) return -3;
    if (shmhb_load(shmhb_word(base, SHMHB_HDR_STATE)) != SHMHB_STATE_READY) return -4;
    if (shmhb_u64(base, SHMHB_HDR_TOTAL_BYTES) > len) return -5;
    return 0;
}

/* Policy in board time units, read once from the header (judge.Thresholds). */
typedef struct {
    uint64_t suspect, dead, agent_stale, peer_suspect, peer_dead;
} shmhb_thresholds;

static inline shmhb_thresholds shmhb_read_thresholds(const void *base) {
    shmhb_thresholds t;
    t.suspect = shmhb_u64(base, SHMHB_HDR_SUSPECT_AFTER_NS) >> SHMHB_TS_SHIFT;
    t.dead = shmhb_u64(base, SHMHB_HDR_DEAD_AFTER_NS) >> SHMHB_TS_SHIFT;
    t.agent_stale = shmhb_u64(base, SHMHB_HDR_AGENT_STALE_NS) >> SHMHB_TS_SHIFT;
    t.peer_suspect = shmhb_u64(base, SHMHB_HDR_PEER_SUSPECT_AFTER_NS) >> SHMHB_TS_SHIFT;
    t.peer_dead = shmhb_u64(base, SHMHB_HDR_PEER_DEAD_AFTER_NS) >> SHMHB_TS_SHIFT;
    return t;
}

static inline uint64_t shmhb_pack_hb(uint64_t incarnation, uint64_t ts, int left) {
    return ((incarnation & SHMHB_INC_MASK) << SHMHB_INC_SHIFT) | (left ? SHMHB_LEFT_BIT : 0)
           | (ts & SHMHB_TS39_MASK);
}

/* --- judging (judge.py; keep the two in step) --------------------------------------- */

/* A local slot from its heartbeat and verdict words; *age in units. */
static inline int shmhb_judge_local(uint64_t hb, uint64_t verdict, uint64_t now,
                                    uint64_t suspect, uint64_t dead, uint64_t *age) {
    uint64_t ts = hb & SHMHB_TS39_MASK;
    *age = now > ts ? now - ts : 0;
    if (hb & SHMHB_LEFT_BIT) return SHMHB_STATUS_LEFT;
    if (verdict && (verdict >> SHMHB_INC_SHIFT) == (hb >> SHMHB_INC_SHIFT))
        return SHMHB_STATUS_DEAD;
    if (*age >= dead) return SHMHB_STATUS_DEAD;
    if (*age >= suspect) return SHMHB_STATUS_SUSPECT;
    return SHMHB_STATUS_ALIVE;
}

/* The agent from its heartbeat word; *has_age is 0 when no agent ever ran. */
static inline int shmhb_judge_agent(uint64_t agent_hb, uint64_t now, uint64_t stale,
                                    uint64_t *age, int *has_age) {
    uint64_t ts = agent_hb & SHMHB_TS39_MASK;
    *has_age = agent_hb != 0;
    *age = now > ts ? now - ts : 0;
    if (agent_hb == 0) return SHMHB_STATUS_UNKNOWN;
    if (agent_hb & SHMHB_LEFT_BIT) return SHMHB_STATUS_LEFT;
    return *age < stale ? SHMHB_STATUS_ALIVE : SHMHB_STATUS_SUSPECT;
}

/* Whether remote verdicts may be trusted: the agent beats and has not left. */
static inline int shmhb_agent_fresh(uint64_t agent_hb, uint64_t now, uint64_t stale) {
    uint64_t ts = agent_hb & SHMHB_TS39_MASK;
    return agent_hb != 0 && !(agent_hb & SHMHB_LEFT_BIT) && (now < ts || now - ts < stale);
}

static inline int shmhb_status_from_code(uint64_t code) {
    return code >= SHMHB_STATUS_ALIVE && code <= SHMHB_STATUS_UNKNOWN ? (int)code
                                                                      : SHMHB_STATUS_UNKNOWN;
}

/* A peer or remote row word of record generation `gen`: -1 when the word belongs to
 * another generation (the row is being rewritten: retry or skip). */
static inline int shmhb_judge_row(uint64_t word, uint64_t gen, int agent_ok, uint64_t now,
                                  uint64_t *age) {
    uint64_t ts = word & SHMHB_TS40_MASK;
    if (((word >> SHMHB_GEN_SHIFT) & SHMHB_GEN_MASK) != (gen & SHMHB_GEN_MASK)) return -1;
    *age = now > ts ? now - ts : 0;
    if (!agent_ok) return SHMHB_STATUS_UNKNOWN;
    return shmhb_status_from_code((word >> SHMHB_CODE_SHIFT) & SHMHB_CODE_MASK);
}

/* A remote worker: what its host reported, bounded by the host's own status. */
static inline int shmhb_combine_remote(int reported, int host) {
    if (host == SHMHB_STATUS_UNKNOWN || host == SHMHB_STATUS_DEAD) return host;
    if (reported == SHMHB_STATUS_LEFT || reported == SHMHB_STATUS_DEAD) return reported;
    if (host == SHMHB_STATUS_LEFT) return SHMHB_STATUS_LEFT; /* it said goodbye */
    if (host == SHMHB_STATUS_SUSPECT) return SHMHB_STATUS_SUSPECT;
    return reported;
}

/* --- record checksums: BLAKE2b, 8-byte digest, person "shmhb-row" (layout.checksum) --- */

typedef struct {
    uint64_t h[8], t;
    uint8_t buf[128];
    size_t n;
} shmhb_blake2b;

static inline uint64_t shmhb__rotr(uint64_t x, int n) { return (x >> n) | (x << (64 - n)); }

static inline void shmhb__compress(shmhb_blake2b *s, int last) {
    static const uint64_t iv[8] = {
        0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL,
        0xa54ff53a5f1d36f1ULL, 0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL,
        0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL};
    static const uint8_t sigma[12][16] = {
        {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
        {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
        {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
        {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
        {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
        {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
        {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
        {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
        {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
        {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
        {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
        {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3}};
    uint64_t v[16], m[16];
    int i, r;
    for (i = 0; i < 16; i++) {
        const uint8_t *b = s->buf + 8 * i;
        m[i] = (uint64_t)b[0] | (uint64_t)b[1] << 8 | (uint64_t)b[2] << 16 |
               (uint64_t)b[3] << 24 | (uint64_t)b[4] << 32 | (uint64_t)b[5] << 40 |
               (uint64_t)b[6] << 48 | (uint64_t)b[7] << 56;
    }
    for (i = 0; i < 8; i++) {
        v[i] = s->h[i];
        v[i + 8] = iv[i];
    }
    v[12] ^= s->t;
    if (last) v[14] = ~v[14];
#define SHMHB__G(a, b, c, d, x, y)                                                     \
    do {                                                                               \
        v[a] = v[a] + v[b] + (x); v[d] = shmhb__rotr(v[d] ^ v[a], 32);                 \
        v[c] = v[c] + v[d]; v[b] = shmhb__rotr(v[b] ^ v[c], 24);                       \
        v[a] = v[a] + v[b] + (y); v[d] = shmhb__rotr(v[d] ^ v[a], 16);                 \
        v[c] = v[c] + v[d]; v[b] = shmhb__rotr(v[b] ^ v[c], 63);                       \
    } while (0)
    for (r = 0; r < 12; r++) {
        const uint8_t *z = sigma[r];
        SHMHB__G(0, 4, 8, 12, m[z[0]], m[z[1]]);
        SHMHB__G(1, 5, 9, 13, m[z[2]], m[z[3]]);
        SHMHB__G(2, 6, 10, 14, m[z[4]], m[z[5]]);
        SHMHB__G(3, 7, 11, 15, m[z[6]], m[z[7]]);
        SHMHB__G(0, 5, 10, 15, m[z[8]], m[z[9]]);
        SHMHB__G(1, 6, 11, 12, m[z[10]], m[z[11]]);
        SHMHB__G(2, 7, 8, 13, m[z[12]], m[z[13]]);
        SHMHB__G(3, 4, 9, 14, m[z[14]], m[z[15]]);
    }
#undef SHMHB__G
    for (i = 0; i < 8; i++) s->h[i] ^= v[i] ^ v[i + 8];
}

static inline void shmhb_blake2b_init(shmhb_blake2b *s) {
    /* parameter block: digest 8, no key, fanout 1, depth 1; person "shmhb-row" */
    static const uint8_t person[16] = {'s', 'h', 'm', 'h', 'b', '-', 'r', 'o', 'w'};
    static const uint64_t iv[8] = {
        0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL,
        0xa54ff53a5f1d36f1ULL, 0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL,
        0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL};
    int i;
    for (i = 0; i < 8; i++) s->h[i] = iv[i];
    s->h[0] ^= 0x01010000ULL | 8;
    s->h[6] ^= shmhb_u64(person, 0);
    s->h[7] ^= shmhb_u64(person, 8);
    s->t = 0;
    s->n = 0;
}

static inline void shmhb_blake2b_update(shmhb_blake2b *s, const void *data, size_t len) {
    const uint8_t *p = (const uint8_t *)data;
    while (len) {
        size_t k;
        if (s->n == 128) { /* a full block is compressed only once more input follows */
            s->t += 128;
            shmhb__compress(s, 0);
            s->n = 0;
        }
        k = 128 - s->n < len ? 128 - s->n : len;
        memcpy(s->buf + s->n, p, k);
        s->n += k;
        p += k;
        len -= k;
    }
}

static inline uint64_t shmhb_blake2b_final(shmhb_blake2b *s) {
    s->t += s->n;
    memset(s->buf + s->n, 0, 128 - s->n);
    shmhb__compress(s, 1);
    return s->h[0]; /* the 8-byte digest, read little-endian */
}

static inline void shmhb_checksum_int(shmhb_blake2b *s, uint64_t v) {
    uint8_t b[8];
    int i;
    for (i = 0; i < 8; i++) b[i] = (uint8_t)(v >> (8 * i));
    shmhb_blake2b_update(s, b, 8);
}

/* A NUL-padded string field as numpy reads it (trailing NULs stripped). */
static inline size_t shmhb_field_len(const char *p, size_t cap) {
    while (cap && p[cap - 1] == 0) cap--;
    return cap;
}

static inline void shmhb_checksum_bytes(shmhb_blake2b *s, const char *p, size_t len) {
    uint8_t n[2];
    n[0] = (uint8_t)(len & 0xff);
    n[1] = (uint8_t)(len >> 8);
    shmhb_blake2b_update(s, n, 2);
    shmhb_blake2b_update(s, p, len);
}

/* layout.record_checksum over a copy of a slot record (SHMHB_REC_BYTES bytes). */
static inline uint64_t shmhb_record_checksum(const char *rec) {
    shmhb_blake2b s;
    uint64_t d;
    shmhb_blake2b_init(&s);
    shmhb_checksum_int(&s, shmhb_u64(rec, SHMHB_REC_INCARNATION));
    shmhb_checksum_int(&s, shmhb_u64(rec, SHMHB_REC_PID));
    shmhb_checksum_int(&s, shmhb_u64(rec, SHMHB_REC_PID_START));
    shmhb_checksum_int(&s, shmhb_u64(rec, SHMHB_REC_PID_NS));
    shmhb_checksum_int(&s, shmhb_u64(rec, SHMHB_REC_REGISTERED_NS));
    shmhb_checksum_bytes(&s, rec + SHMHB_REC_KEY,
                         shmhb_field_len(rec + SHMHB_REC_KEY, SHMHB_KEY_BYTES));
    shmhb_checksum_bytes(&s, rec + SHMHB_REC_ENDPOINTS,
                         shmhb_field_len(rec + SHMHB_REC_ENDPOINTS, SHMHB_ENDPOINTS_BYTES));
    d = shmhb_blake2b_final(&s);
    return d ? d : 1;
}

/* A validated copy of slot i's record (rec: SHMHB_REC_BYTES bytes) that matches its
 * heartbeat word.  Returns 1 with *hb set, 0 for an empty slot, -1 while it is being
 * rewritten (retry later).  The copy is taken between two loads of the heartbeat word
 * and must carry a good checksum naming the word's incarnation. */
static inline int shmhb_read_record(const void *base, uint32_t i, char *rec, uint64_t *hb) {
    size_t slot_off = (size_t)shmhb_u64(base, SHMHB_HDR_SLOT_OFF);
    size_t rec_off = (size_t)shmhb_u64(base, SHMHB_HDR_RECORD_OFF);
    const uint64_t *w = shmhb_word(base, slot_off + (size_t)i * SHMHB_SLOT_BYTES + SHMHB_SLOT_HB);
    int tries;
    for (tries = 0; tries < 8; tries++) {
        uint64_t h = shmhb_load(w), ck;
        size_t k;
        if ((h >> SHMHB_INC_SHIFT) == 0) return 0;
        for (k = 0; k < SHMHB_REC_BYTES; k += 8) { /* word by word: each load is atomic */
            uint64_t x = shmhb_load(shmhb_word(base, rec_off + (size_t)i * SHMHB_REC_BYTES + k));
            memcpy(rec + k, &x, 8);
        }
        ck = shmhb_u64(rec, SHMHB_REC_CHECKSUM);
        if (ck && ck == shmhb_record_checksum(rec) &&
            (shmhb_u64(rec, SHMHB_REC_INCARNATION) & SHMHB_INC_MASK) == (h >> SHMHB_INC_SHIFT)) {
            *hb = h;
            return 1;
        }
    }
    return -1;
}

#ifdef __cplusplus
}
#endif
#endif /* SHMHB_H */

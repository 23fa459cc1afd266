/* A native reader of a shmhb board: the local slots and the agent, judged by the rule
 * in shmhb.h, printed as JSON in the shape of `shmhb status --json` (the fields a
 * native reader needs: key, pid, incarnation, status).  No Python involved.
 *
 *   cc -std=c99 -O2 -I"$(python -c 'import shmhb; print(shmhb.get_include())')" \
 *      examples/board_status.c -o board_status      # add -lrt on glibc < 2.34
 *   ./board_status shmhb                            # the board's name
 *
 * Exit status: 0 if every local slot is alive or left (like `shmhb status`), 1 if not,
 * 2 if the board cannot be opened.
 */
#define _POSIX_C_SOURCE 200809L
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "shmhb.h"

static void print_json_string(const char *s, size_t n) {
    size_t i;
    putchar('"');
    for (i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '"' || c == '\\') printf("\\%c", c);
        else if (c < 0x20) printf("\\u%04x", c);
        else putchar(c); /* UTF-8 bytes pass through */
    }
    putchar('"');
}

static uint64_t now_units(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ((uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec) >> SHMHB_TS_SHIFT;
}

int main(int argc, char **argv) {
    char path[256], rec[SHMHB_REC_BYTES];
    struct stat st;
    const char *base;
    uint32_t i, nslots;
    uint64_t now, age, agent_hb;
    shmhb_thresholds th;
    int fd, first = 1, healthy = 1, has_age, agent;

    if (argc != 2) {
        fprintf(stderr, "usage: %s BOARD\n", argv[0]);
        return 2;
    }
    snprintf(path, sizeof path, "/%s", argv[1]);
    fd = shm_open(path, O_RDONLY, 0);
    if (fd < 0 || fstat(fd, &st) != 0) {
        perror(path);
        return 2;
    }
    base = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    if (base == MAP_FAILED || shmhb_header_ok(base, (size_t)st.st_size) != 0) {
        fprintf(stderr, "%s: not a finished shmhb board of layout %d\n", path,
                SHMHB_LAYOUT_VERSION);
        return 2;
    }
    th = shmhb_read_thresholds(base);
    nslots = shmhb_u32(base, SHMHB_HDR_NSLOTS);
    now = now_units();

    printf("{\"board\": ");
    print_json_string(argv[1], strlen(argv[1]));
    printf(", \"slots\": [");
    for (i = 0; i < nslots; i++) {
        size_t off = (size_t)shmhb_u64(base, SHMHB_HDR_SLOT_OFF) + (size_t)i * SHMHB_SLOT_BYTES;
        uint64_t hb, verdict;
        int code;
        if (shmhb_read_record(base, i, rec, &hb) != 1) continue; /* empty or mid-write */
        verdict = shmhb_load(shmhb_word(base, off + SHMHB_SLOT_VERDICT));
        code = shmhb_judge_local(hb, verdict, now, th.suspect, th.dead, &age);
        if (code != SHMHB_STATUS_ALIVE && code != SHMHB_STATUS_LEFT) healthy = 0;
        printf("%s{\"key\": ", first ? "" : ", ");
        print_json_string(rec + SHMHB_REC_KEY, shmhb_field_len(rec + SHMHB_REC_KEY, SHMHB_KEY_BYTES));
        printf(", \"pid\": %llu, \"incarnation\": %llu, \"status\": \"%s\", \"age_s\": %.3f}",
               (unsigned long long)shmhb_u64(rec, SHMHB_REC_PID),
               (unsigned long long)shmhb_u64(rec, SHMHB_REC_INCARNATION),
               shmhb_status_name(code), (double)age * SHMHB_TS_UNIT_NS / 1e9);
        first = 0;
    }
    agent_hb = shmhb_load(shmhb_word(base, SHMHB_HDR_AGENT_HB));
    agent = shmhb_judge_agent(agent_hb, now, th.agent_stale, &age, &has_age);
    printf("], \"pinger\": {\"status\": \"%s\", \"term\": %llu}}\n", shmhb_status_name(agent),
           (unsigned long long)(agent_hb >> SHMHB_INC_SHIFT));
    return healthy ? 0 : 1;
}

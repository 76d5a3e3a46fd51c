/* Small helpers shared by the example guests: reading a file, top-1, failing loudly. */
#ifndef WASINN_GUEST_UTIL_H
#define WASINN_GUEST_UTIL_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "wasi_nn.h"

static inline void check(nn_errno err, const char *what) {
    if (err != NN_SUCCESS) {
        fprintf(stderr, "%s failed: wasi-nn errno %u\n", what, (unsigned)err);
        exit(10 + (int)(err > 100 ? err - 90 : err)); /* distinct, below 128 */
    }
}

/* The whole file at path, malloc'ed; *len receives its size. Exits on failure. */
static inline uint8_t *read_file(const char *path, uint32_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) { fprintf(stderr, "cannot open %s\n", path); exit(2); }
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *buf = malloc(size > 0 ? (size_t)size : 1);
    if (!buf || fread(buf, 1, (size_t)size, f) != (size_t)size) {
        fprintf(stderr, "cannot read %s\n", path); exit(2);
    }
    fclose(f);
    *len = (uint32_t)size;
    return buf;
}

static inline uint32_t top1(const float *scores, uint32_t n) {
    uint32_t best = 0;
    for (uint32_t i = 1; i < n; i++) if (scores[i] > scores[best]) best = i;
    return best;
}

#endif

/* Moves one big tensor into the host and back, to measure guest <-> host transfer.
 *
 * usage: transfer NAME COUNT REPEAT
 *   NAME    a registered f32 identity model over shape (n, 4)
 *   COUNT   n: the tensor is n x 4 f32 (16 * n bytes each way)
 *   REPEAT  how many set_input / compute / get_output rounds to time
 * Prints "guest: R rounds of B bytes, T ms each" and exits 3 if the output differs. */
#include <time.h>

#include "guest_util.h"

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

int main(int argc, char **argv) {
    if (argc < 4) { fprintf(stderr, "usage: %s NAME COUNT REPEAT\n", argv[0]); return 1; }
    const char *name = argv[1];
    uint32_t n = (uint32_t)atoi(argv[2]);
    int repeat = atoi(argv[3]);
    uint32_t bytes = n * 4 * (uint32_t)sizeof(float);
    float *in = malloc(bytes), *out = malloc(bytes);
    if (!in || !out) { fprintf(stderr, "out of memory\n"); return 2; }
    for (uint32_t i = 0; i < n * 4; i++) in[i] = (float)i;

    nn_graph graph;
    nn_context ctx;
    check(nn_load_by_name(name, (uint32_t)strlen(name), &graph), "load_by_name");
    check(nn_init_execution_context(graph, &ctx), "init_execution_context");
    uint32_t dims[2] = {n, 4}, written = 0;
    nn_tensor tensor = { dims, 2, NN_TYPE_F32, in, bytes };
    double start = now_ms();
    for (int r = 0; r < repeat; r++) {
        check(nn_set_input(ctx, 0, &tensor), "set_input");
        check(nn_compute(ctx), "compute");
        check(nn_get_output(ctx, 0, out, bytes, &written), "get_output");
    }
    double elapsed = now_ms() - start;
    if (written != bytes || memcmp(in, out, bytes) != 0) { fprintf(stderr, "output differs\n"); return 3; }
    printf("guest: %d rounds of %u bytes, %.3f ms each\n", repeat, (unsigned)bytes, elapsed / repeat);
    return 0;
}

/* Image classifier that asks the host for a model by name with `load_by_name`.
 *
 * usage: classify_named [--legacy] [--target N] [--repeat N] NAME INPUT_FILE
 *   NAME        a model the host registered (config, --nn-preload, --wasi nn-graph)
 *   INPUT_FILE  a raw little-endian f32 tensor of shape 1x3x224x224
 * By default it uses wasinn's extensions: a context bound to a target, the input set by
 * name and the output buffer bound before compute. --legacy uses only the calls every
 * wasi-nn host has (set_input / get_output by index). --repeat runs N inferences and
 * prints the guest-side time per inference (the mean, and the median of the first 4096).
 * Prints "top-1: class N score S". */
#include <time.h>

#include "guest_util.h"

#define CLASSES 1000
#define MAX_SAMPLES 4096

static double samples[MAX_SAMPLES];

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

int main(int argc, char **argv) {
    int legacy = 0, repeat = 1, argi = 1;
    uint32_t target = NN_TARGET_CPU;
    while (argi < argc && strncmp(argv[argi], "--", 2) == 0) {
        if (strcmp(argv[argi], "--legacy") == 0) legacy = 1;
        else if (strcmp(argv[argi], "--target") == 0 && argi + 1 < argc) target = (uint32_t)atoi(argv[++argi]);
        else if (strcmp(argv[argi], "--repeat") == 0 && argi + 1 < argc) repeat = atoi(argv[++argi]);
        else { fprintf(stderr, "unknown option %s\n", argv[argi]); return 1; }
        argi++;
    }
    if (argc - argi < 2) { fprintf(stderr, "usage: %s [--legacy] [--target N] [--repeat N] NAME INPUT\n", argv[0]); return 1; }
    const char *name = argv[argi];
    uint32_t input_len;
    uint8_t *input = read_file(argv[argi + 1], &input_len);

    nn_graph graph;
    check(nn_load_by_name(name, (uint32_t)strlen(name), &graph), "load_by_name");
    nn_context ctx;
    static float scores[CLASSES];
    uint32_t written = 0;
    static const uint32_t dims[4] = {1, 3, 224, 224};
    nn_tensor tensor = { dims, 4, NN_TYPE_F32, input, input_len };
    if (legacy) {
        check(nn_init_execution_context(graph, &ctx), "init_execution_context");
    } else {
        check(nn_init_execution_context_on(graph, target, &ctx), "init_execution_context_on");
        check(nn_set_output_by_name(ctx, "output", 6, scores, sizeof scores, &written),
              "set_output_by_name");
    }
    double start = now_ms();
    for (int i = 0; i < repeat; i++) {
        double begin = now_ms();
        if (legacy) {
            check(nn_set_input(ctx, 0, &tensor), "set_input");
            check(nn_compute(ctx), "compute");
            check(nn_get_output(ctx, 0, scores, sizeof scores, &written), "get_output");
        } else {
            check(nn_set_input_by_name(ctx, "input", 5, &tensor), "set_input_by_name");
            check(nn_compute(ctx), "compute");
        }
        if (i < MAX_SAMPLES) samples[i] = now_ms() - begin;
    }
    double elapsed = now_ms() - start;
    uint32_t best = top1(scores, written / sizeof(float));
    printf("top-1: class %u score %.4f\n", (unsigned)best, scores[best]);
    if (repeat > 1) {
        int n = repeat < MAX_SAMPLES ? repeat : MAX_SAMPLES;
        qsort(samples, (size_t)n, sizeof samples[0], by_value);
        printf("guest: %d inferences, %.3f ms each, median %.3f ms\n", repeat, elapsed / repeat,
               samples[n / 2]);
    }
    check(nn_finalize_execution_context(ctx), "finalize_execution_context");
    check(nn_unload(graph), "unload");
    return 0;
}

/* Two models chained: the first model's output is the second model's input.
 *
 * usage: chain FIRST SECOND INPUT_FILE
 *   FIRST, SECOND  registered model names (load_by_name); FIRST takes a 1x3x224x224 f32
 *                  tensor, SECOND a 1xN f32 tensor where N is FIRST's output length
 * Prints the top-1 of each stage: "first: class N score S" and "second: class N score S". */
#include "guest_util.h"

#define MAX_OUT 4096

static uint32_t run(const char *name, const uint32_t *dims, uint32_t rank, const void *data,
                    uint32_t len, float *out) {
    nn_graph graph;
    nn_context ctx;
    uint32_t written = 0;
    check(nn_load_by_name(name, (uint32_t)strlen(name), &graph), "load_by_name");
    check(nn_init_execution_context(graph, &ctx), "init_execution_context");
    nn_tensor tensor = { dims, rank, NN_TYPE_F32, data, len };
    check(nn_set_input(ctx, 0, &tensor), "set_input");
    check(nn_compute(ctx), "compute");
    check(nn_get_output(ctx, 0, out, MAX_OUT * sizeof(float), &written), "get_output");
    check(nn_finalize_execution_context(ctx), "finalize_execution_context");
    check(nn_unload(graph), "unload");
    return written / sizeof(float);
}

int main(int argc, char **argv) {
    if (argc < 4) { fprintf(stderr, "usage: %s FIRST SECOND INPUT\n", argv[0]); return 1; }
    uint32_t input_len;
    uint8_t *input = read_file(argv[3], &input_len);
    static float first[MAX_OUT], second[MAX_OUT];
    static const uint32_t image_dims[4] = {1, 3, 224, 224};
    uint32_t n = run(argv[1], image_dims, 4, input, input_len, first);
    uint32_t best = top1(first, n);
    printf("first: class %u score %.4f\n", (unsigned)best, first[best]);
    uint32_t dims[2] = {1, n};
    uint32_t m = run(argv[2], dims, 2, first, n * sizeof(float), second);
    best = top1(second, m);
    printf("second: class %u score %.4f\n", (unsigned)best, second[best]);
    return 0;
}

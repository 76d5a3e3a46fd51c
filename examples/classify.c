/* Image classifier that loads its model from files with `load`.
 *
 * usage: classify MODEL_FILE[+WEIGHTS_FILE] INPUT_FILE [ENCODING [TARGET]]
 *   MODEL_FILE  model bytes (e.g. model.onnx, model.pt) in a preopened directory;
 *               an OpenVINO IR is given as model.xml+model.bin (two builders)
 *   INPUT_FILE  a raw little-endian f32 tensor of shape 1x3x224x224
 *   ENCODING    WITX number, default 5 (autodetect); TARGET default 0 (cpu)
 * Prints "top-1: class N score S". */
#include "guest_util.h"

#define CLASSES 1000

int main(int argc, char **argv) {
    if (argc < 3) { fprintf(stderr, "usage: %s MODEL INPUT [ENCODING [TARGET]]\n", argv[0]); return 1; }
    uint32_t encoding = argc > 3 ? (uint32_t)atoi(argv[3]) : NN_ENCODING_AUTODETECT;
    uint32_t target = argc > 4 ? (uint32_t)atoi(argv[4]) : NN_TARGET_CPU;
    char *weights_path = strchr(argv[1], '+');
    if (weights_path) *weights_path++ = '\0';
    uint32_t model_len, weights_len = 0, input_len;
    uint8_t *model = read_file(argv[1], &model_len);
    uint8_t *weights = weights_path ? read_file(weights_path, &weights_len) : NULL;
    uint8_t *input = read_file(argv[2], &input_len);

    nn_builder builders[2] = { { model, model_len }, { weights, weights_len } };
    nn_graph graph;
    check(nn_load(builders, weights ? 2 : 1, encoding, target, &graph), "load");
    free(model); /* the host keeps its own copy */
    free(weights);
    nn_context ctx;
    check(nn_init_execution_context(graph, &ctx), "init_execution_context");

    static const uint32_t dims[4] = {1, 3, 224, 224};
    nn_tensor tensor = { dims, 4, NN_TYPE_F32, input, input_len };
    check(nn_set_input(ctx, 0, &tensor), "set_input");
    check(nn_compute(ctx), "compute");

    static float scores[CLASSES];
    uint32_t written = 0;
    check(nn_get_output(ctx, 0, scores, sizeof scores, &written), "get_output");
    uint32_t best = top1(scores, written / sizeof(float));
    printf("top-1: class %u score %.4f\n", (unsigned)best, scores[best]);
    check(nn_finalize_execution_context(ctx), "finalize_execution_context");
    check(nn_unload(graph), "unload");
    return 0;
}

/* wasi_ephemeral_nn for C guests: the legacy wasi-nn ABI, WasmEdge's extensions and
 * wasinn's own (see wit/wasinn_ephemeral_nn.witx). Every function returns an errno. */
#ifndef WASINN_WASI_NN_H
#define WASINN_WASI_NN_H

#include <stdint.h>

typedef uint32_t nn_errno;
typedef uint32_t nn_graph;
typedef uint32_t nn_context;

enum { NN_SUCCESS = 0, NN_INVALID_ARGUMENT = 1, NN_INVALID_ENCODING = 2,
       NN_MISSING_MEMORY = 3, NN_BUSY = 4, NN_RUNTIME_ERROR = 5,
       NN_UNSUPPORTED_OPERATION = 6, NN_TOO_LARGE = 7, NN_NOT_FOUND = 8,
       NN_END_OF_SEQUENCE = 100, NN_MODEL_NOT_FOUND = 103 };

/* WITX numbering (autodetect = 5, ggml = 6). */
enum { NN_ENCODING_OPENVINO = 0, NN_ENCODING_ONNX = 1, NN_ENCODING_TENSORFLOW = 2,
       NN_ENCODING_PYTORCH = 3, NN_ENCODING_TFLITE = 4, NN_ENCODING_AUTODETECT = 5,
       NN_ENCODING_GGML = 6 };
enum { NN_TARGET_CPU = 0, NN_TARGET_GPU = 1, NN_TARGET_TPU = 2 };
enum { NN_TYPE_F16 = 0, NN_TYPE_F32 = 1, NN_TYPE_F64 = 2, NN_TYPE_U8 = 3,
       NN_TYPE_I32 = 4, NN_TYPE_I64 = 5, NN_TYPE_BF16 = 6 };

typedef struct { const uint8_t *data; uint32_t len; } nn_builder;

/* The 20-byte tensor record. */
typedef struct {
    const uint32_t *dims; uint32_t dims_len;
    uint32_t type; /* only the low byte counts */
    const void *data; uint32_t data_len;
} nn_tensor;

#define NN_IMPORT(name) __attribute__((import_module("wasi_ephemeral_nn"), import_name(name)))

NN_IMPORT("load") nn_errno nn_load(const nn_builder *builders, uint32_t n, uint32_t encoding,
                                   uint32_t target, nn_graph *graph);
NN_IMPORT("load_by_name") nn_errno nn_load_by_name(const char *name, uint32_t name_len,
                                                   nn_graph *graph);
NN_IMPORT("load_by_name_with_config") nn_errno nn_load_by_name_with_config(
    const char *name, uint32_t name_len, const char *config, uint32_t config_len,
    nn_graph *graph);
NN_IMPORT("init_execution_context") nn_errno nn_init_execution_context(nn_graph graph,
                                                                       nn_context *ctx);
NN_IMPORT("set_input") nn_errno nn_set_input(nn_context ctx, uint32_t index,
                                             const nn_tensor *tensor);
NN_IMPORT("compute") nn_errno nn_compute(nn_context ctx);
NN_IMPORT("get_output") nn_errno nn_get_output(nn_context ctx, uint32_t index, void *out,
                                               uint32_t out_max, uint32_t *written);
NN_IMPORT("unload") nn_errno nn_unload(nn_graph graph);
NN_IMPORT("finalize_execution_context") nn_errno nn_finalize_execution_context(nn_context ctx);

/* wasinn extensions */
NN_IMPORT("init_execution_context_on") nn_errno nn_init_execution_context_on(
    nn_graph graph, uint32_t target, nn_context *ctx);
NN_IMPORT("set_input_by_name") nn_errno nn_set_input_by_name(
    nn_context ctx, const char *name, uint32_t name_len, const nn_tensor *tensor);
NN_IMPORT("get_output_by_name") nn_errno nn_get_output_by_name(
    nn_context ctx, const char *name, uint32_t name_len, void *out, uint32_t out_max,
    uint32_t *written);
NN_IMPORT("set_output_by_name") nn_errno nn_set_output_by_name(
    nn_context ctx, const char *name, uint32_t name_len, void *out, uint32_t out_max,
    uint32_t *written);

#endif

"""ONNX Runtime's session config entries: which keys it reads, so that a misspelt one is
not passed on to be ignored without a word (``SessionOptions.add_session_config_entry``
takes any key, and ONNX Runtime never reads one it does not know).

The names are those of ``onnxruntime_session_options_config_keys.h`` and of the keys
ONNX Runtime 1.31 reads in the areas ``session.``, ``optimization.`` and ``mlas.``.
``ep.`` entries are left alone: execution providers make their own names.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable

#: A session config entry's key, as ONNX Runtime names them: ``AREA.NAME``.
CONFIG_KEY = re.compile(r"(session|optimization|mlas|ep)\.[A-Za-z0-9_.]+")

#: The areas whose keys are all ONNX Runtime's own (checked against :data:`KNOWN`).
_CHECKED = ("session.", "optimization.", "mlas.")

KNOWN: frozenset[str] = frozenset({
    "mlas.disable_kleidiai",
    "mlas.kleidiai.conv_igemm_max_work",
    "mlas.nchwc_depthwise_sliding",
    "mlas.nchwc_pointwise_conv_max_input_channel_batch",
    "mlas.qnbit.force_fp32",
    "mlas.use_lut_gemm",
    "optimization.constant_folding_max_output_size_in_bytes",
    "optimization.disable_specified_optimizers",
    "optimization.enable_cast_chain_elimination",
    "optimization.enable_gelu_approximation",
    "optimization.enable_memory_probe_recompute_config",
    "optimization.memory_optimizer_config",
    "optimization.minimal_build_optimizations",
    "session.allow_released_opsets_only",
    "session.collect_node_memory_stats_to_file",
    "session.compile_only",
    "session.debug_layout_transformation",
    "session.disable_aot_function_inlining",
    "session.disable_cpu_ep_fallback",
    "session.disable_double_qdq_remover",
    "session.disable_model_compile",
    "session.disable_prepacking",
    "session.disable_qdq_constant_folding",
    "session.disable_quant_qdq",
    "session.dynamic_block_base",
    "session.enable_cpu_mem_arena",
    "session.enable_dq_matmulnbits_fusion",
    "session.enable_mem_pattern",
    "session.enable_moe_expert_counting",
    "session.enable_moe_expert_statistics",
    "session.enable_profiling",
    "session.enable_quant_qdq_cleanup",
    "session.enable_saved_runtime_optimizations",
    "session.execution_mode",
    "session.fail_on_suboptimal_compiled_model",
    "session.force_spinning_stop",
    "session.function_expansion_byte_limit",
    "session.function_expansion_node_limit",
    "session.gqa_value_layout",
    "session.graph_optimization_level",
    "session.graph_optimizations_loop_level",
    "session.inter_op.allow_spinning",
    "session.inter_op.spin_backoff_max",
    "session.inter_op.spin_duration_us",
    "session.inter_op_num_threads",
    "session.intra_op.allow_spinning",
    "session.intra_op.spin_backoff_max",
    "session.intra_op.spin_duration_us",
    "session.intra_op_num_threads",
    "session.intra_op_thread_affinities",
    "session.layer_assignment_settings",
    "session.load_model_format",
    "session.log_id",
    "session.log_severity_level",
    "session.log_verbosity_level",
    "session.max_shape_override",
    "session.model_external_initializers_file_folder_path",
    "session.moe_expert_counter_alpha",
    "session.moe_expert_counter_beta",
    "session.moe_expert_counter_state_file",
    "session.name_based_layer_assignment",
    "session.node_partition_config_file",
    "session.optimized_model_external_initializers_file_name",
    "session.optimized_model_external_initializers_min_size_in_bytes",
    "session.optimized_model_filepath",
    "session.prepack.enable_parallel",
    "session.qdq_matmulnbits_accuracy_level",
    "session.qdq_matmulnbits_block_size",
    "session.qdqisint8allowed",
    "session.record_ep_graph_assignment_info",
    "session.resource_cuda_partitioning_settings",
    "session.save_external_prepacked_constant_initializers",
    "session.save_model_format",
    "session.set_denormal_as_zero",
    "session.set_ep_dynamic_options",
    "session.strict_shape_type_inference",
    "session.strict_workspace_verification",
    "session.use_deterministic_compute",
    "session.use_device_allocator_for_initializers",
    "session.use_env_allocators",
    "session.use_external_initializer_file_buffers_directly",
    "session.use_memory_mapped_ort_model",
    "session.use_ort_model_bytes_directly",
    "session.use_ort_model_bytes_for_initializers",
    "session.use_per_session_threads",
    "session.x64quantprecision",
})


def is_config_key(key: str) -> bool:
    """Whether ``key`` has the form of a session config entry's key."""
    return CONFIG_KEY.fullmatch(key) is not None


def unknown(keys: Iterable[str]) -> list[tuple[str, list[str]]]:
    """Each of ``keys`` in an area of ONNX Runtime's own that it does not read, with the
    known keys closest to it (most alike first; empty where none is close)."""
    return [(key, difflib.get_close_matches(key, KNOWN, n=2, cutoff=0.85))
            for key in keys if key.startswith(_CHECKED) and key not in KNOWN]

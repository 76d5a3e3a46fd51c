"""The OpenVINO properties wasinn sets from ``LoadOptions``' own fields, which a model's
options may not set as well (the two could contradict): the OpenVINO backend sets them
(:func:`wasinn.backends.openvino.compile_config`), and the config and load checks
(:func:`wasinn.configs.option_problem`) refuse them as options, without importing
OpenVINO."""

#: property -> the LoadOptions field (a config's model key) that sets it.
SET_FROM_OPTIONS: dict[str, str] = {
    "INFERENCE_PRECISION_HINT": "precision",
    "INFERENCE_NUM_THREADS": "threads",
}

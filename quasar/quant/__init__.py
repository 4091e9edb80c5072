"""W8A8 quantization: calibration, smoothing and rotation, the int8 layer and its kernels,
checkpoints (see ARCHITECTURE.md).

Importing the package registers the W8A8 and W4A8 checkpoint formats with the model loader;
the checkpoint code itself (and torch) is imported only when such a checkpoint is loaded.
"""

from quasar.models.formats import register_quantized_format


def _prepare_w8a8(model, quant_config: dict, tensors: dict) -> int:
    from quasar.quant.checkpoint import prepare_quantized_modules  # lazy: torch; the package (w4a8_layouts) stays light

    return prepare_quantized_modules(model, quant_config, tensors)


def _prepare_w4a8(model, quant_config: dict, tensors: dict) -> int:
    from quasar.quant.w4a8_checkpoint import prepare_w4a8_modules  # lazy: torch; the package (w4a8_layouts) stays light

    return prepare_w4a8_modules(model, quant_config, tensors)


register_quantized_format("compressed-tensors", _prepare_w8a8)
register_quantized_format("quasar-w4a8", _prepare_w4a8)

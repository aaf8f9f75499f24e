"""The table of weight formats: the names checkpoint configs and the command line use -> `QuantFormat`.

    MODELOPT_ALGOS     ModelOpt `quant_algo` (hf_quant_config.json, or config.json `quant_method: modelopt`)
    COMPRESSED_TENSORS compressed-tensors `format` (the group's strategy and activations refine the layout)
    GPT_OSS_MXFP4      `quant_method: mxfp4` (gpt-oss: `weight_blocks` / `weight_scales`)
    QUANTIZE_FORMATS   `hybrid quantize --format NAME` -> the ModelOpt `quant_algo` it writes

A new format is a `moe.quant.codec.Codec` subclass and one line:
`register("int8", "INT8_PER_CHANNEL", QuantFormat(INT8, Layout(granularity="channel")))`.
"""

from __future__ import annotations

from dataclasses import replace

from moe.quant.codec import Layout, QuantFormat
from moe.quant.fp8 import FP8
from moe.quant.mxfp4 import MXFP4
from moe.quant.nvfp4 import NVFP4

CT_FP8_NAMES = {"data": "weight", "scale": "weight_scale", "input": "input_scale"}
CT_FP4_NAMES = {"data": "weight_packed", "scale": "weight_scale", "global": "weight_global_scale",
                "input": "input_global_scale"}
CT_MXFP4_NAMES = {"data": "weight_packed", "scale": "weight_scale"}
GPT_OSS_NAMES = {"data": "weight_blocks", "scale": "weight_scales"}

MODELOPT = Layout()
MODELOPT_ALGOS: dict[str, QuantFormat] = {
    "FP8": QuantFormat(FP8, replace(MODELOPT, input_scale=True)),
    "FP8_PER_CHANNEL_PER_TOKEN": QuantFormat(FP8, replace(MODELOPT, granularity="channel")),
    "FP8_PB_WO": QuantFormat(FP8, replace(MODELOPT, granularity="block")),
    "NVFP4": QuantFormat(NVFP4, replace(MODELOPT, input_scale=True)),
    "W4A16_NVFP4": QuantFormat(NVFP4, MODELOPT),
    "MXFP4": QuantFormat(MXFP4, MODELOPT),
}
COMPRESSED_TENSORS: dict[str, QuantFormat] = {
    "float-quantized": QuantFormat(FP8, Layout(dict(CT_FP8_NAMES), scalar_shape=(1,))),
    "nvfp4-pack-quantized": QuantFormat(NVFP4, Layout(dict(CT_FP4_NAMES), divisor=True, scalar_shape=(1,))),
    "mxfp4-pack-quantized": QuantFormat(MXFP4, Layout(dict(CT_MXFP4_NAMES), scalar_shape=(1,))),
}
GPT_OSS_MXFP4 = QuantFormat(MXFP4, Layout(dict(GPT_OSS_NAMES), blocks_layout=True))
QUANTIZE_FORMATS: dict[str, str] = {"fp8": "FP8", "nvfp4": "NVFP4", "mxfp4": "MXFP4"}


def register(name: str, modelopt_algo: str, fmt: QuantFormat) -> None:
    """Make `fmt` readable from checkpoints that declare `quant_algo: modelopt_algo` and writable by
    `hybrid quantize --format name` (and `hybrid info --format name`).

    Raises:
        ValueError: the name or the algorithm is taken.
    """
    if name in QUANTIZE_FORMATS or modelopt_algo in MODELOPT_ALGOS:
        raise ValueError(f"format {name!r} or quant_algo {modelopt_algo!r} is already registered")
    MODELOPT_ALGOS[modelopt_algo] = fmt
    QUANTIZE_FORMATS[name] = modelopt_algo


def unregister(name: str) -> None:
    """Undo `register(name, ...)`."""
    MODELOPT_ALGOS.pop(QUANTIZE_FORMATS.pop(name))

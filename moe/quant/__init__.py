"""Weight formats and packed modules, usable by any Linear; nothing here knows a model or imports the rest of `moe`.

    e2m1.py, e4m3.py, e8m0.py    element and scale encodings (encode / decode as pure functions)
    codec.py                     Codec (a format's numbers), Layout (a producer's storage), QuantFormat = both
    fp8.py, nvfp4.py, mxfp4.py   the three formats: quantize / dequantize functions and their codec
    formats.py                   the table: config and command-line names -> QuantFormat; `register`
    config.py                    ModelOpt, compressed-tensors and `mxfp4` quantization configs -> a format per
                                 module name; ModelOpt's files, written
    packed.py, linear.py         PackedWeight (a weight held as its packed tensors), PackedExperts (a stack held
                                 one expert at a time: views of a checkpoint's map), QuantLinear
    swap.py                      swap_modules: the one module-swapping loop
    kernels/                     CPU (C++, oneDNN) and Triton kernels, and the operations choosing them
                                 beside their references (packed products, the routed experts, the router);
                                 the modules holding bf16 weights prepacked for the CPU (PrepackedLinear, ...)

Modules are addressed by their dotted names only.
"""

from moe.quant import formats
from moe.quant.codec import Codec, Layout, QuantFormat
from moe.quant.linear import QuantLinear
from moe.quant.packed import PackedExperts, PackedWeight
from moe.quant.kernels.prepacked import Prepacked, PrepackedLinear
from moe.quant.swap import swap_modules

__all__ = ["Codec", "Layout", "PackedExperts", "PackedWeight", "Prepacked", "PrepackedLinear", "QuantFormat", "QuantLinear",
           "formats", "swap_modules"]

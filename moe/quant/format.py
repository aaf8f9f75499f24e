"""`QuantFormat`: how one quantized weight is stored (which tensors, their names, shapes and dtypes) and how
it turns back into numbers. Pure data plus dispatch to the format modules; no model knowledge.

A format has a kind and tensors in roles:

    kind    data                       scale                          global              input
    fp8     e4m3 [out, in]             fp32, per tensor/channel/block  -                   fp32 static act. scale
    nvfp4   uint8 [out, in/2]          e4m3 [out, in/16]              fp32 (mult. or div.) fp32 act. global scale
    mxfp4   uint8 [out, in/2]          E8M0 uint8 [out, in/32]        -                   -

The tensor names are the producer's: ModelOpt (`weight`, `weight_scale`, `weight_scale_2`, `input_scale`),
compressed-tensors (`weight_packed` / `weight`, `weight_scale`, `weight_global_scale`,
`input_global_scale` / `input_scale`), gpt-oss MXFP4 (`weight_blocks [out, in/32, 16]`, `weight_scales`).
Stacked expert banks add a leading expert dimension to every tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moe.quant import fp8, mxfp4, nvfp4

KINDS = ("fp8", "nvfp4", "mxfp4")
ROLES = ("data", "scale", "global", "input")

MODELOPT_NAMES = {"data": "weight", "scale": "weight_scale", "global": "weight_scale_2", "input": "input_scale"}
CT_FP4_NAMES = {"data": "weight_packed", "scale": "weight_scale", "global": "weight_global_scale",
                "input": "input_global_scale"}
CT_FP8_NAMES = {"data": "weight", "scale": "weight_scale", "input": "input_scale"}
GPT_OSS_NAMES = {"data": "weight_blocks", "scale": "weight_scales"}


@dataclass(frozen=True)
class QuantFormat:
    """One weight's storage format.

    kind: "fp8", "nvfp4" or "mxfp4".
    granularity: FP8 scale granularity ("tensor", "channel", "block"); block: FP8 block edge (128).
    group: elements per block scale (16 for NVFP4, 32 for MXFP4).
    divisor: NVFP4 global scale is compressed-tensors' divisor (True) or ModelOpt's multiplier (False).
    input_scale: a static activation scale tensor is stored (and kept).
    names: role -> tensor name (see the module docstring).
    scalar_shape: the shape scalars have on disk: () for ModelOpt, (1,) for compressed-tensors.
    blocks_layout: the data is stored as gpt-oss `*_blocks [out, in/32, 16]` rather than [out, in/2].
    label: the name reported to people ("FP8", "NVFP4", "MXFP4", with the granularity for FP8).
    """

    kind: str
    granularity: str = "tensor"
    block: int = fp8.BLOCK
    group: int = 0
    divisor: bool = False
    input_scale: bool = False
    names: dict = field(default_factory=lambda: dict(MODELOPT_NAMES), compare=False, hash=False)
    scalar_shape: tuple = ()
    blocks_layout: bool = False

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown quantization kind {self.kind!r}; expected one of {KINDS}")
        if self.kind == "fp8":
            fp8.fp8_scale_shape(1, 1, self.granularity, self.block)
        elif not self.group:
            object.__setattr__(self, "group", nvfp4.GROUP if self.kind == "nvfp4" else mxfp4.GROUP)

    @property
    def label(self) -> str:
        if self.kind == "fp8":
            return "FP8" if self.granularity == "tensor" else f"FP8-{self.granularity}"
        return self.kind.upper()

    @property
    def roles(self) -> tuple[str, ...]:
        roles = ["data", "scale"]
        if self.kind == "nvfp4":
            roles.append("global")
        if self.input_scale:
            roles.append("input")
        return tuple(roles)

    # ------------------------------------------------------------------------------------------ layout
    def check_shape(self, out_features: int, in_features: int, where: str = "") -> None:
        """Raise ValueError (naming `where`) if an [out, in] weight cannot be stored in this format."""
        if self.kind != "fp8" and in_features % self.group:
            raise ValueError(f"{where}: in_features {in_features} is not a multiple of the {self.label} block "
                             f"size {self.group}")

    def tensor_specs(self, out_features: int, in_features: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """{tensor name: (shape, dtype)} of one [out, in] weight (prepend the expert dim for a bank)."""
        o, i, s = out_features, in_features, self.scalar_shape
        if self.kind == "fp8":
            scale_shape = fp8.fp8_scale_shape(o, i, self.granularity, self.block)
            if scale_shape == ():
                scale_shape = s
            elif self.granularity == "channel" and s == (1,):  # compressed-tensors keeps [out, 1]
                scale_shape = (o, 1)
            specs = {"data": ((o, i), torch.float8_e4m3fn), "scale": (scale_shape, torch.float32)}
        elif self.kind == "nvfp4":
            specs = {"data": ((o, i // 2), torch.uint8), "scale": ((o, i // self.group), torch.float8_e4m3fn),
                     "global": (s, torch.float32)}
        else:
            data = (o, i // self.group, self.group // 2) if self.blocks_layout else (o, i // 2)
            specs = {"data": (data, torch.uint8), "scale": ((o, i // self.group), torch.uint8)}
        if self.input_scale:
            specs["input"] = (s, torch.float32)
        return {self.names[role]: spec for role, spec in specs.items()}

    def packed_nbytes(self, out_features: int, in_features: int) -> int:
        """Bytes of every tensor of one [out, in] weight in this format."""
        total = 0
        for shape, dtype in self.tensor_specs(out_features, in_features).values():
            n = 1
            for d in shape:
                n *= d
            total += n * torch.empty((), dtype=dtype).element_size()
        return total

    # ------------------------------------------------------------------------------------------ numbers
    def dequantize(self, t: dict[str, torch.Tensor]) -> torch.Tensor:
        """Role tensors (`{"data": ..., "scale": ..., "global": ...}`, leading dims allowed) -> fp32 weight."""
        data, scale = t["data"], t["scale"]
        if self.kind == "fp8":
            if self.granularity == "tensor":
                scale = scale.reshape(data.shape[:-2])
            elif self.granularity == "channel":
                scale = scale.reshape(data.shape[:-1])
            return fp8.dequantize_fp8(data, scale, self.granularity, self.block)
        if self.kind == "nvfp4":
            g = t["global"].reshape(data.shape[:-2])
            return nvfp4.dequantize_nvfp4(data, scale, g, divisor=self.divisor, group=self.group)
        if self.blocks_layout:
            data = data.flatten(-2)
        return mxfp4.dequantize_mxfp4(data, scale, group=self.group)

    def quantize(self, w: torch.Tensor, input_amax: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Weight [..., out, in] -> {tensor name: tensor} in this format (ModelOpt arithmetic for NVFP4 unless
        `divisor`). `input_amax` ([...] fp32, calibrated) gives the static input scale when the format has one.
        """
        lead = w.shape[:-2]
        out: dict[str, torch.Tensor] = {}
        if self.kind == "fp8":
            q, scale = fp8.quantize_fp8(w, self.granularity, self.block)
            out = {"data": q, "scale": scale}
        elif self.kind == "nvfp4":
            packed, scale, g = nvfp4.quantize_nvfp4(w, convention="compressed-tensors" if self.divisor else "modelopt",
                                                    group=self.group)
            out = {"data": packed, "scale": scale, "global": g}
        else:
            packed, scale = mxfp4.quantize_mxfp4(w, group=self.group)
            out = {"data": packed.unflatten(-1, (-1, self.group // 2)) if self.blocks_layout else packed,
                   "scale": scale}
        if self.input_scale:
            if input_amax is None:
                raise ValueError(f"{self.label} with a static input scale needs calibrated input amax values")
            out["input"] = input_scale_from_amax(self, input_amax.float().reshape(lead))
        specs = self.tensor_specs(w.shape[-2], w.shape[-1])
        return {self.names[r]: v.reshape(lead + specs[self.names[r]][0]).contiguous() for r, v in out.items()}


def input_scale_from_amax(fmt: QuantFormat, amax: torch.Tensor) -> torch.Tensor:
    """Static activation scale from a calibrated amax (ModelOpt `get_activation_scaling_factor`):
    FP8 `amax / 448`; NVFP4 `amax / (6 * 448)` (a multiplier; compressed-tensors' divisor is its inverse).
    An amax of 0 (never seen) gives scale 1.0."""
    denom = 448.0 if fmt.kind == "fp8" else 6.0 * 448.0
    scale = torch.where(amax > 0, amax / denom, torch.ones_like(amax))
    return 1.0 / scale if fmt.divisor else scale

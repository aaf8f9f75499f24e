"""A weight format as one object: a `Codec` (the numbers) combined with a `Layout` (how a producer stores them).

    QuantFormat(codec, layout)
        codec    FP8, NVFP4, MXFP4 (`moe.quant.fp8` / `nvfp4` / `mxfp4`) or any subclass of `Codec`: element
                 and scale encodings, quantize, dequantize, activation quantize-dequantize, the static input
                 scale, the config arguments that describe it
        layout   which producer's tensor names, the FP8 scale granularity (tensor / channel / 128-block), an
                 NVFP4 global scale stored as multiplier or divisor, a static input scale, scalar shapes

Every tensor of a quantized weight plays a role:

    role     fp8                          nvfp4                        mxfp4
    data     e4m3 [out, in]               uint8 [out, in/2]            uint8 [out, in/2]
    scale    fp32 per tensor/channel/     e4m3 [out, in/16]            E8M0 uint8 [out, in/32]
             block
    global   -                            fp32 (multiplier/divisor)    -
    input    fp32 static act. scale       fp32 act. global scale       -

A stack of expert weights adds a leading expert dimension to every tensor. `moe.quant.formats` maps the
names checkpoint configs use to formats; adding a format is one `Codec` subclass and one `register` line.
"""

from __future__ import annotations

import math

from dataclasses import dataclass, field

import torch

MODELOPT_NAMES = {"data": "weight", "scale": "weight_scale", "global": "weight_scale_2", "input": "input_scale"}
SLICE_ELEMENTS = 1 << 22  # weights quantized at a time by `by_row_slices` (fp32 temporaries of 16 MB each)


def by_row_slices(quantize, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`quantize(w)` computed on slices of w's rows (dim -2) of about `SLICE_ELEMENTS` weights each, its output
    tensors concatenated along dim -2. Equal to `quantize(w)` bit for bit when each output row depends on its
    own input row alone (a block-scaled format, with any tensor-wide number computed beforehand), while the
    temporaries stay those of one slice: quantizing a 10,304 x 2,688 matrix to NVFP4 at once took temporaries
    many times its own bf16 bytes (docs/perf-log.md#quantize-row-slices). `quantize`: w [..., rows, in] -> a
    tuple of [..., rows, *] tensors."""
    row = math.prod(w.shape[:-2]) * w.shape[-1] if w.dim() >= 2 else 0  # weights per row index (all matrices)
    rows = max(1, SLICE_ELEMENTS // row) if row else 0
    if not rows or w.shape[-2] <= rows:
        return quantize(w)
    parts = [quantize(w[..., i:i + rows, :]) for i in range(0, w.shape[-2], rows)]
    return tuple(torch.cat(outs, dim=-2) for outs in zip(*parts))


@dataclass(frozen=True)
class Layout:
    """How one producer stores a format's tensors (the numbers are the codec's).

    names: role -> tensor name (ModelOpt's by default; compare=False: the same numbers under other names
        are the same format).
    granularity: FP8 scale granularity, "tensor", "channel" or "block"; block: the FP8 block edge.
    divisor: the NVFP4 global scale is compressed-tensors' divisor (True) or ModelOpt's multiplier (False).
    input_scale: a static activation scale tensor is stored (and kept).
    scalar_shape: the shape scalars have on disk: () for ModelOpt, (1,) for compressed-tensors.
    blocks_layout: MXFP4 data as gpt-oss `*_blocks [out, in/32, 16]` rather than [out, in/2].
    """

    names: dict = field(default_factory=lambda: dict(MODELOPT_NAMES), compare=False, hash=False)
    granularity: str = "tensor"
    block: int = 128
    divisor: bool = False
    input_scale: bool = False
    scalar_shape: tuple = ()
    blocks_layout: bool = False


class Codec:
    """The numbers of one weight format. Subclasses set `name` (and `group` for block formats) and implement
    `specs`, `quantize` and `dequantize` (enough to load and run a checkpoint in the format) and
    `weight_args` (to write one: `hybrid quantize`); `label`, `roles` and `check_shape` have defaults;
    `input_scale` and `fake_quantize` only formats with static input scales or activation emulation need;
    `units` only formats to load under tensor parallelism.

    All methods take the `Layout` the tensors are stored in; tensors are passed by role
    (`{"data": ..., "scale": ...}`) and may carry leading (expert) dimensions.
    """

    name = ""  # the format's short name ("fp8"), also what `hybrid quantize --format` registers it under
    group = 0  # elements sharing one scale along the input dimension (0: the scale is not per block)
    granularities: tuple[str, ...] = ()  # scale granularities a layout may choose (FP8: tensor, channel, block)

    # ------------------------------------------------------------------------------------ storage
    def label(self, layout: Layout) -> str:
        """The name shown to people ("FP8", "FP8-channel", "NVFP4", ...)."""
        return self.name.upper()

    def roles(self, layout: Layout) -> tuple[str, ...]:
        return ("data", "scale") + (("input",) if layout.input_scale else ())

    def specs(self, layout: Layout, out_features: int, in_features: int) -> dict[str, tuple[tuple, torch.dtype]]:
        """{role: (shape, dtype)} of one [out, in] weight's tensors, the input scale excluded."""
        raise NotImplementedError

    def check_shape(self, layout: Layout, out_features: int, in_features: int) -> str | None:
        """Why an [out, in] weight cannot be stored in this format, or None."""
        if self.group and in_features % self.group:
            return f"in_features {in_features} is not a multiple of the {self.label(layout)} block size {self.group}"
        return None

    def units(self, layout: Layout) -> dict[str, tuple[int | None, int | None]]:
        """{role: (rows, cols)}: how many rows / columns of the [out, in] weight one step along the role
        tensor's first / second dimension covers (None: the tensor has no such dimension, one value serves every
        row / column). A role not named (a global or input scale) is one value for the whole weight. Tensor
        parallelism (`hybrid.parallel.packed`) cuts a role tensor only at whole steps."""
        raise NotImplementedError(f"{type(self).__name__} does not say how its tensors split "
                                  "(implement units to shard it under tensor parallelism)")

    # ------------------------------------------------------------------------------------ numbers
    def quantize(self, w: torch.Tensor, layout: Layout) -> dict[str, torch.Tensor]:
        """Weight [..., out, in] (any float dtype) -> {role: tensor}, the input scale excluded."""
        raise NotImplementedError

    def dequantize(self, t: dict[str, torch.Tensor], layout: Layout) -> torch.Tensor:
        """{role: tensor} (leading dims allowed) -> the float32 weight [..., out, in]."""
        raise NotImplementedError

    def input_scale(self, amax: torch.Tensor, layout: Layout) -> torch.Tensor:
        """The stored static activation scale for calibrated input amax values (formats with an input role)."""
        raise ValueError(f"{self.label(layout)} stores no static input scale")

    def fake_quantize(self, x: torch.Tensor, layout: Layout, input_scale: torch.Tensor | None) -> torch.Tensor:
        """x [..., in] after a quantize-dequantize round trip in this format's activation format (fp32)."""
        raise ValueError(f"{self.label(layout)} has no activation quantization")

    # ------------------------------------------------------------------------------------ configs
    def weight_args(self, layout: Layout) -> dict:
        """The `weights` quantization arguments describing this format in a config.json `config_groups` entry
        (the compressed-tensors vocabulary ModelOpt writes too), e.g. `{"dynamic": False, "num_bits": 8,
        "type": "float", "strategy": "channel"}`."""
        raise NotImplementedError(f"{type(self).__name__} does not say how to describe it in a config "
                                  "(implement weight_args to write checkpoints in this format)")


@dataclass(frozen=True)
class QuantFormat:
    """One weight's storage format: the codec's numbers in a producer's layout."""

    codec: Codec
    layout: Layout = Layout()

    @property
    def label(self) -> str:
        return self.codec.label(self.layout)

    @property
    def roles(self) -> tuple[str, ...]:
        return self.codec.roles(self.layout)

    @property
    def names(self) -> dict[str, str]:
        return self.layout.names

    def check_shape(self, out_features: int, in_features: int, where: str = "") -> None:
        """Raise ValueError (naming `where`) if an [out, in] weight cannot be stored in this format."""
        why = self.codec.check_shape(self.layout, out_features, in_features)
        if why:
            raise ValueError(f"{where}: {why}")

    def tensor_specs(self, out_features: int, in_features: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """{tensor name: (shape, dtype)} of one [out, in] weight (prepend the expert dim for a bank)."""
        specs = self.codec.specs(self.layout, out_features, in_features)
        if self.layout.input_scale:
            specs["input"] = (self.layout.scalar_shape, torch.float32)
        return {self.names[role]: spec for role, spec in specs.items()}

    def units(self) -> dict[str, tuple[int | None, int | None]]:
        """{tensor name: (rows, cols)} (`Codec.units`), every role named; (None, None) for a scalar."""
        units = self.codec.units(self.layout)
        return {self.names[role]: units.get(role, (None, None)) for role in self.roles}

    def step(self, axis: int) -> int:
        """The fewest weight rows (`axis` 0) or columns (1) a cut may take without cutting any tensor's step:
        the lcm of `units()` along that axis."""
        return math.lcm(*(u[axis] for u in self.units().values() if u[axis] is not None))

    def packed_nbytes(self, out_features: int, in_features: int) -> int:
        """Bytes of every tensor of one [out, in] weight in this format."""
        return sum(torch.Size(shape).numel() * dtype.itemsize
                   for shape, dtype in self.tensor_specs(out_features, in_features).values())

    def quantize(self, w: torch.Tensor, input_amax: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Weight [..., out, in] -> {tensor name: tensor} in this format. `input_amax` ([...] fp32, calibrated)
        gives the static input scale when the layout has one.

        Raises:
            ValueError: the layout has a static input scale and no `input_amax` was given.
        """
        lead = w.shape[:-2]
        out = self.codec.quantize(w, self.layout)
        if self.layout.input_scale:
            if input_amax is None:
                raise ValueError(f"{self.label} with a static input scale needs calibrated input amax values")
            out["input"] = self.codec.input_scale(input_amax.float().reshape(lead), self.layout)
        specs = self.tensor_specs(w.shape[-2], w.shape[-1])
        return {self.names[r]: v.reshape(lead + specs[self.names[r]][0]).contiguous() for r, v in out.items()}

    def dequantize(self, t: dict[str, torch.Tensor]) -> torch.Tensor:
        """Role tensors (leading dims allowed) -> the fp32 weight."""
        return self.codec.dequantize(t, self.layout)

    def fake_quantize(self, x: torch.Tensor, input_scale: torch.Tensor | None) -> torch.Tensor:
        """x after this format's activation quantize-dequantize (W8A8 / W4A4 emulation), in x's dtype."""
        return self.codec.fake_quantize(x.float(), self.layout, input_scale).to(x.dtype)

"""The one table of dtype names: config.json's (`torch_dtype`, `mamba_ssm_cache_dtype`), the command line's
short forms, and torch's."""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # config.json names
ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # the command line's


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    """The torch dtype of a config or command-line name (or a torch dtype, checked).

    Raises:
        ValueError: a name or dtype that is not float32, bfloat16 or float16 (or fp32, bf16, fp16).
    """
    if isinstance(name, torch.dtype):
        if name not in DTYPES.values():
            raise ValueError(f"dtype {name} is not supported; use bfloat16, float16 or float32")
        return name
    dtype = DTYPES.get(ALIASES.get(name, name))
    if dtype is None:
        raise ValueError(f"dtype {name!r} is not supported; expected one of {sorted(DTYPES) + sorted(ALIASES)}")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """The config.json name of a torch dtype ("bfloat16"); for dtypes outside the table, torch's own name
    without the `torch.` prefix ("float8_e4m3fn")."""
    return str(dtype).removeprefix("torch.")

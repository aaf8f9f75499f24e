"""The layers of the hybrid stack, one file each: norms, Mamba-2 mixer, attention, MLP, the MoE layer."""

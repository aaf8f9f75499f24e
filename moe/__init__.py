"""Mixture-of-Experts building blocks: the router, the resident expert bank, and the MoE layer."""

from moe.experts import ExpertBank
from moe.layer import MoE
from moe.router import TopkRouter, route

__all__ = ["ExpertBank", "MoE", "TopkRouter", "route"]

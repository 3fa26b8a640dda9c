"""Initializations shared by the bilinear model's memory heads and the Gated DeltaNet peer (a file of its own: a saved
model of either copies it as remote code without the other's modeling code)."""
import math

import torch
from transformers import initialization as init


@torch.no_grad()
def init_time_step_bias_(dt_bias: torch.Tensor) -> None:
    """Fill a gated delta rule's ``dt_bias`` so that its step at a zero input, ``softplus(dt_bias)``, is log-uniform
    in (0.001, 0.1): Mamba's initialization, and the Gated DeltaNet paper's (flash-linear-attention's layer)."""
    dt = torch.empty(dt_bias.shape).uniform_(math.log(1e-3), math.log(1e-1)).exp()
    init.copy_(dt_bias, dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)

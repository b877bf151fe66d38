"""Layout rules a family's attention brings (`ModelSpec.check_layout`), each written once: the families call them
from their own rules, checked with the config before any rank starts (utils.tasks `check_pairing`)."""

from __future__ import annotations

from typing import Any

from utils import require


def check_heads(num_heads: int, parallel: Any) -> None:
    """Attention heads split over tp ranks, and over cp ranks by the all-to-all attentions."""
    tp, cp = parallel.tp, parallel.cp
    require(num_heads % tp == 0, f"model.num_heads={num_heads} is not divisible by parallel.tp={tp}",
            "parallel.tp",
            f"choose a parallel.tp that divides {num_heads}, or model.num_heads a multiple of parallel.tp")
    split = {"alltoall": cp, "hierarchical": parallel.cp_a2a}.get(parallel.cp_attention, 1)
    require(cp == 1 or num_heads % (tp * split) == 0,
            f"parallel.cp_attention={parallel.cp_attention} splits each tp rank's {num_heads // tp} heads over "
            f"{split} ranks", "parallel.cp_attention",
            f"use a model.num_heads that is a multiple of {tp * split}, or parallel.cp_attention=ring or allgather")

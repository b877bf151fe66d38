"""The FLOP formula behind perf/tflops_per_sec and perf/mfu (utils/engine/flops.py, `training_flops_per_sample`,
as utils/engine/build.py's `flops_per_sample` calls it) against torch's own counter
(`torch.utils.flop_counter.FlopCounterMode`) over one forward and backward of the real model, built the way the
trainer builds it (`utils.engine.build.build_model` on one CPU process), per preset family: the ViT, GPT and
Llama, causal and with packed-document attention (`data.packing=documents data.attention=document`).

What each side counts, per sample of S tokens (L blocks of width D, N_mm weights in nn.Linear modules):
- the formula: 6 N_mm S for the weight matmuls (2 forward, 4 backward) plus 12 L D S^2 for the attention
  scores and values (4 L D S^2 forward, 8 backward), that term halved for a causal model (the flash kernels
  skip the masked blocks). Not counted: the embedding lookup (a gather, not a matmul), norms, activations,
  biases, softmax, rotary, the loss.
- the counter: every aten mm/addmm/bmm (and SDPA kernel) it sees, full-sized: it knows nothing of masks, so a
  causal or document-masked attention counts all S^2 scores.
The sides agree within 1% (exactly, in fact) once three differences are taken out, each computed here:
1. causal halving: the counter counts the attention's 12 L D S^2 in full, the formula half of it (GPT and
   Llama: the formula is below the counter by 6 L D S^2).
2. the ViT's patch embedding: its input is data, which needs no gradient, so autograd runs 4 of the 6 FLOPs
   per weight and token (no input gradient); the formula counts 6 (ViT: the formula is above the counter by
   2 S C p^2 D).
3. packed documents with document attention: the core gets a dense (B, 1, S, S) mask, so the model computes all
   S^2 scores (as the counter says), the formula counts the causal half (the attention cores say causal), and
   the useful work (the pairs inside one document, j <= i) is less than either; asserted here as an ordering.
Attention is counted on SDPA's math backend: on the CPU the fused kernel (aten._scaled_dot_product_flash_
attention_for_cpu) has no FLOP formula in torch 2.13 and counts 0, while the math path runs the scores and
values as bmm, which the counter sees, forward and backward (12 L D S^2 per sample, the formula's full term).
On CUDA the flash and efficient kernels are counted by torch's SDPA formulas, whose backward adds the score
recompute: 14 L D S^2 (not run here). The per-family numbers are in docs/measurements.md.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from networks.documents import pack_ids
from utils.cli.config import load_config
from utils.comm import init_grid
from utils.engine.build import build_model
from utils.tasks import build_task

BATCH = 2  # two samples: the counter's figure is per batch, the formula's per sample
VOCAB = 256  # a small vocabulary keeps the LM head at about 4% of the weights, not the 90% of GPT-2's 50,257
SEQ = ["data=wikitext_sample", "data.seq_len=64"]
DOCUMENTS = ["data.packing=documents", "data.attention=document"]
# document starts of the two rows of the document cases: lengths 24, 24, 16 and 10, 30, 24
STARTS = ((0, 24, 48), (0, 10, 40))

CASES = {  # the tiny presets at their own widths and depths (D 128, 4 blocks), short sequences
    "vit": ["model=vit_tiny", "data=era5_synthetic"],  # 128 patches of 4x4 on 32x64, 20 channels
    "gpt": ["model=gpt_tiny", *SEQ],
    "llama": ["model=llama_tiny", *SEQ],  # grouped-query attention, SwiGLU, untied head
    "gpt_documents": ["model=gpt_tiny", *SEQ, *DOCUMENTS],
    "llama_documents": ["model=llama_tiny", *SEQ, *DOCUMENTS],
}


def _batch(task, documents: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = task.example_batch(BATCH, device)
    if documents:  # rows of several documents (the example batch's plain ids read as one document per row)
        starts = torch.zeros_like(x, dtype=torch.bool)
        for row, cuts in enumerate(STARTS):
            starts[row, list(cuts)] = True
        x = pack_ids(x, starts)
    return x, y


def _count(task, model, x, y) -> tuple[float, float]:
    """(all FLOPs, the attention cores' FLOPs) of one training forward and backward of the batch, per the counter."""
    counter = FlopCounterMode(display=False)
    with sdpa_kernel(SDPBackend.MATH), counter:
        task.training_loss(model, model.criterion, x, y, 0).backward()
    per_module = counter.get_flop_counts()
    attention = sum(sum(ops.values()) for name, ops in per_module.items() if name.endswith(".attn.attend"))
    return counter.get_total_flops(), attention


@pytest.mark.parametrize("case", list(CASES))
def test_formula_agrees_with_torch_flop_counter(case, tmp_path):
    cfg, _, _ = load_config([*CASES[case], f"data.root={tmp_path}"])
    task = build_task(cfg, load_data=False)
    if hasattr(task, "data_less_vocab"):
        task.data_less_vocab = VOCAB
    grid = init_grid(cfg.parallel)
    built = build_model(cfg, task, grid)  # the trainer's path: meta build, the formula, materialize
    model, formula = built.raw, built.flops_per_sample
    documents = "data.attention=document" in CASES[case]
    x, y = _batch(task, documents, grid.device)
    total, attention = _count(task, model, x, y)
    total, attention = total / BATCH, attention / BATCH

    tokens, depth, width = task.tokens_per_sample(), cfg.model.depth, cfg.model.embed_dim
    causal = case != "vit"
    assert attention > 0, "the counter saw no attention matmul (a fused SDPA kernel it has no formula for?)"
    # what the counter counts: the full S x S scores and values of every block, forward and backward ...
    assert attention == pytest.approx(12 * depth * width * tokens**2, rel=1e-2)
    # ... and the weight matmuls of every nn.Linear, 6 FLOPs per weight and token, less the input gradient that
    # autograd skips where a linear reads the data (the ViT's patch embedding)
    skipped = 2 * tokens * model.patch_embed.weight.numel() if case == "vit" else 0
    assert total - attention == pytest.approx(6 * tokens * model.matmul_params() - skipped, rel=1e-2)
    # the formula is the counter's figure less the causal half of the attention, plus the skipped input gradient
    expected = total - attention + skipped + attention * (0.5 if causal else 1.0)
    assert formula == pytest.approx(expected, rel=1e-2), (
        f"{case}: formula {formula:.6g}, counter {total:.6g} ({formula / total - 1:+.2%}); expected {expected:.6g}")
    if documents:  # the useful attention (query-key pairs inside one document, j <= i) < formula's < computed
        pairs = model.read_documents(x).mask().sum().item() / BATCH
        useful, counted = 12 * depth * width * pairs, formula - (total - attention + skipped)
        assert useful < counted < attention

"""Packed documents with per-document attention through the real entry point: llama_tiny on a corpus of short
articles (10 to 44 tokens: every row of 64 holds several boundaries; `data.packing=documents
data.attention=document`) under tp2, cp2 with each variant (ring, all-gather,
all-to-all; hierarchical needs two groups: cp4), pp2 (1F1B, interleaved 1F1B and the zero-bubble V: several
stages per rank, each given its micro-batch's ids), FSDP dp2, tp2 x cp2 and cp2 with activation checkpointing (the
recomputed blocks read the same documents) follows the single-process loss curve, gradient
norm and validation loss (fp32, relative 1e-4), and that curve is not the one of rows cut from one stream.
"""

import pytest

from tests.helpers import TINY_GPT
from tests.test_layouts import LAYOUTS, curves, run_layout
from tests.test_wikitext import write_text

pytestmark = pytest.mark.slow  # trains through the entry point on several ranks

STEPS = 4
PACKED = ["model=llama_tiny", "data=wikitext", *TINY_GPT[2:], "data.seq_len=64", "data.limit_eval_tokens=512",
          "trainer.global_batch_size=4", "data.packing=documents", "data.attention=document"]
PACKED_LAYOUTS = {"tp2": LAYOUTS["tp2"], "cp2_ring": LAYOUTS["cp2"], "cp2_allgather": [*LAYOUTS["cp2"],
                  "parallel.cp_attention=allgather"], "cp2_alltoall": LAYOUTS["cp2_alltoall"],
                  "cp4_hierarchical": LAYOUTS["cp4_hierarchical"], "pp2": LAYOUTS["pp2_1f1b"],
                  "fsdp_dp2": LAYOUTS["fsdp_dp2"], "cp2_accum2_ckpt": LAYOUTS["cp2_accum2_ckpt"],
                  "tp2cp2": ["parallel=tp2cp2"], "pp2_interleaved": LAYOUTS["pp2_interleaved"],
                  "pp2_zbv": ["parallel=pp2", "parallel.pp_schedule=zbv"]}


def same(reference, other) -> None:
    for ref, got in zip(reference, other, strict=True):
        assert len(got) == len(ref) and got == pytest.approx(ref, rel=1e-4)


def article(i: int) -> list[str]:
    """A short article: its title, then 1 to 5 lines of 4 to 9 words."""
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "far"]
    body = [" ".join(words[(i + j + w) % len(words)] for w in range(4 + (i * j) % 6)) for j in range(1 + i % 5)]
    return [f" = Title {i % 7} = ", *body]


@pytest.fixture(scope="module")
def corpus_root(tmp_path_factory):
    lines = {"train": [line for i in range(80) for line in article(i)],
             "valid": [line for i in range(80, 100) for line in article(i)],
             "test": [line for i in range(100, 110) for line in article(i)]}
    return write_text(tmp_path_factory.mktemp("articles"), lines=lines)


@pytest.fixture(scope="module")
def packed_reference(tmp_path_factory, corpus_root):
    tmp = tmp_path_factory.mktemp("packed")
    return curves(run_layout(tmp, "single", PACKED, f"data.root={corpus_root}", f"trainer.max_steps={STEPS}")), tmp


def test_packed_documents_change_the_curve(packed_reference, corpus_root):
    reference, tmp = packed_reference
    concat = curves(run_layout(tmp, "concat", PACKED, f"data.root={corpus_root}", f"trainer.max_steps={STEPS}",
                               "data.packing=concat", "data.attention=causal"))
    assert len(concat[0]) == len(reference[0]) == STEPS and concat[0][1:] != pytest.approx(reference[0][1:], rel=1e-3)


@pytest.mark.parametrize("layout", list(PACKED_LAYOUTS))
def test_packed_layouts_follow_the_single_process_curve(layout, packed_reference, corpus_root):
    reference, tmp = packed_reference
    same(reference, curves(run_layout(tmp, layout, PACKED, f"data.root={corpus_root}", f"trainer.max_steps={STEPS}",
                                                 *PACKED_LAYOUTS[layout])))



def test_gpt_learned_positions_packed_under_cp2_and_pp2(tmp_path, corpus_root):
    """GPT-2's learned position table read at positions reset per document, before the cp split (the full
    rows) and on the first pipeline stage only: cp2 and pp2 follow the single process."""
    gpt = ["model=gpt_tiny", *PACKED[1:], f"data.root={corpus_root}", f"trainer.max_steps={STEPS}"]
    reference = curves(run_layout(tmp_path, "single", gpt))
    for layout in ("cp2_ring", "pp2"):
        same(reference, curves(run_layout(tmp_path, layout, gpt, *PACKED_LAYOUTS[layout])))

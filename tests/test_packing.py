"""Packed documents (`data.packing=documents`, `data.attention=document`) on one process: the rows the reader
makes (whole documents, the remainder carried, starts flagged, no target predicted from another document), the
positions and masks the model reads back, a packed row equal to its documents run alone, and the refusals."""

from pathlib import Path

import numpy as np
import pytest
import torch

from networks.documents import Documents, pack_ids, unpack_ids
from networks.transformer import GPT, GPTConfig, LlamaConfig
from tests.test_wikitext import write_text
from utils import ConfigError
from utils.language.data.packing import document_starts, is_title
from utils.language.data.wikitext import WikiTextConfig, load_wikitext

ARTICLE = [" = Title {i} = ", " ", " words of article {i} go here . ", " = = Part = = ", " more {i} text . "]


def articles(count: int, offset: int = 0) -> list[str]:
    return [line.format(i=i + offset) for i in range(count) for line in ARTICLE]


def load(root: Path, **kw):
    lines = {"train": articles(5), "valid": articles(3, 5), "test": articles(2, 8)}
    return load_wikitext(WikiTextConfig(root=str(write_text(root, lines=lines)), seq_len=kw.pop("seq_len", 8), **kw))


def test_titles_and_starts():
    assert is_title("= Title 3 =") and not is_title("= = Part = =") and not is_title("a = b")
    eos = 9
    ids = np.array([1, 2, eos, 3, eos, 4, 5, eos, 6, eos])  # lines: title, text, title, text
    lines = ["= A =", "a", "= B =", "b"]
    assert document_starts(ids, lines, eos).tolist() == [0, 4]  # B's document opens with the <eos> before it
    with pytest.raises(ConfigError, match="data.packing"):
        document_starts(ids, lines[:3], eos)


def test_rows_hold_whole_documents_and_carry_the_remainder(tmp_path):
    corpus = load(tmp_path / "wt", packing="documents")
    eos, stream = corpus.tokenizer.eos_id, np.asarray(corpus.train)
    starts = corpus.starts["train"]
    assert len(starts) == 5 and all(stream[s] == eos for s in starts[1:])  # one per article, at its <eos>
    data, concat = corpus.dataset("train", 8), load(tmp_path / "wt", seq_len=8).dataset("train", 8)
    flagged = []
    for i in range(len(data)):
        x, y = data[i]
        tokens, flags = unpack_ids(x)
        cx, cy = concat[i]
        assert torch.equal(tokens, cx) and torch.equal(y, cy)  # the same stream, cut at the same places
        flagged += [i * 8 + j for j in flags.nonzero().flatten().tolist()]
        # no target is a next document's own token: where a document starts at t+1, the input at t+1 is its <eos>
        for t in (flags[1:].nonzero().flatten()).tolist():
            assert y[t] == eos
    assert flagged == [s for s in starts.tolist() if s < len(data) * 8]
    # a document cut at a row's end goes on in the next row, which starts at position 0
    x, _ = data[1]
    positions = Documents.read(x[None], masked=True).positions[0]
    assert positions[0] == 0 and not unpack_ids(x)[1][0]


def test_positions_and_mask_reset_per_document():
    starts = torch.tensor([[False, False, True, False, False, True], [False] * 6])
    docs = Documents(starts, masked=True)
    assert docs.positions.tolist() == [[0, 1, 0, 1, 2, 0], list(range(6))]
    assert docs.ids.tolist() == [[0, 0, 1, 1, 1, 2], [0] * 6]
    mask = docs.mask()[:, 0]
    want = torch.zeros(6, 6, dtype=torch.bool)
    for a, b in ((0, 2), (2, 5), (5, 6)):
        want[a:b, a:b] = torch.ones(b - a, b - a, dtype=torch.bool).tril()
    assert torch.equal(mask[0], want) and torch.equal(mask[1], torch.ones(6, 6, dtype=torch.bool).tril())
    assert bool(Documents(starts, masked=False).mask()[0, 0, 3, 0])  # causal only: across documents
    ids = pack_ids(torch.tensor([5, 6, 7]), torch.tensor([False, True, False]))
    assert [t.tolist() for t in unpack_ids(ids)] == [[5, 6, 7], [False, True, False]]


@pytest.mark.parametrize("cfg", [LlamaConfig(embed_dim=32, depth=2, num_heads=4, num_kv_heads=2, mlp_hidden=64,
                                             max_positions=32), GPTConfig(embed_dim=32, depth=2, num_heads=4,
                                                                          max_positions=32)], ids=["llama", "gpt"])
def test_packed_row_equals_its_documents_alone(cfg):
    torch.manual_seed(0)
    model = GPT(cfg, 50)
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randint(50, (2, 5), generator=gen), torch.randint(50, (2, 7), generator=gen)
    starts = torch.zeros(2, 12, dtype=torch.bool)
    starts[:, 5] = True
    row = pack_ids(torch.cat([a, b], 1), starts)
    alone = [model(a), model(b)]  # plain ids: one document per row
    model.documents = "document"
    packed = model(row)
    torch.testing.assert_close(packed, torch.cat(alone, 1), rtol=1e-5, atol=1e-5)
    model.documents = "causal"  # positions reset, attention across documents: the second one sees the first
    assert not torch.allclose(model(row)[:, 5:], alone[1], atol=1e-3)
    model.documents = None
    assert not torch.allclose(model(torch.cat([a, b], 1))[:, 5:], alone[1], atol=1e-3)


@pytest.mark.parametrize("overrides, setting", [({"attention": "document"}, "data.attention"),
                                                ({"packing": "rows"}, "data.packing"),
                                                ({"attention": "full"}, "data.attention")])
def test_refusals(overrides, setting):
    with pytest.raises(ConfigError) as err:
        WikiTextConfig(sample=True, **overrides)
    assert err.value.setting == setting


@pytest.mark.parametrize("args, setting", [
    (["model=llama_tiny", "data.packing=documents", "precision.compile=true"], "(precision.compile)"),
    (["model=llama_tiny", "data.attention=document"], "(data.attention)"),
    (["data=era5_synthetic", "model=vit_tiny", "data.attention=document"], "data.attention")])
def test_train_refuses_in_one_line(args, setting):
    from tests.helpers import run_main

    code, _, err = run_main("train.py", "data=wikitext_sample", *args)
    assert code == 2 and err.count("\n") == 1 and setting in err

"""The GPT language model: shapes, causality, weight tying, vocabulary-padding invariance, errors."""

import pytest
import torch
from torch import nn

from networks.blocks import Block, SequenceRegion
from networks.transformer import GPT, CausalLMLoss, GPTConfig, check_seq_len, padded_vocab_size
from utils import ConfigError
from utils.comm import Grid
from utils.language.task.generate import greedy_decode

SERIAL_TP = Grid.serial().axis("tp")

VOCAB = 100


def small(**overrides) -> GPTConfig:
    args = dict(embed_dim=32, depth=2, num_heads=4, max_positions=16)
    args.update(overrides)
    return GPTConfig(**args)


def build(seed: int = 0, vocab: int = VOCAB, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(small(**overrides), vocab)


def tokens(batch: int = 2, seq: int = 12, vocab: int = VOCAB, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("positions", ["learned", "rotary"])
@pytest.mark.parametrize("tie", [True, False])
def test_shapes_and_layout_convention(positions, tie):
    model = build(positions=positions, tie_embeddings=tie)
    assert model.padded_vocab == 128
    assert model.tok_embed.weight.shape == (128, 32)
    assert (model.pos_embed is not None) == (positions == "learned")
    assert isinstance(model.enter_seq, SequenceRegion) and model.enter_seq.kind == "enter"
    assert isinstance(model.blocks, nn.ModuleList) and all(isinstance(b, Block) for b in model.blocks)
    assert all(b.attn.attend.causal and b.attn.rotary == (positions == "rotary") for b in model.blocks)
    assert model.lm_head.bias is None and model.criterion.num_valid_vocab == VOCAB
    logits = model(tokens())
    assert logits.shape == (2, 12, 128)
    loss = model.criterion(logits, tokens(seed=2))
    assert loss.ndim == 0 and torch.isfinite(loss)
    loss.backward()


@pytest.mark.parametrize("positions", ["learned", "rotary"])
def test_causal(positions):
    model = build(positions=positions).eval()
    a = tokens()
    b = a.clone()
    b[:, 7:] = (b[:, 7:] + 1) % VOCAB  # change only the future of position 6
    la, lb = model(a), model(b)
    torch.testing.assert_close(la[:, :7], lb[:, :7])
    assert not torch.allclose(la[:, 7:], lb[:, 7:])


def test_tied_weights_share_storage():
    tied, untied = build(tie_embeddings=True), build(tie_embeddings=False)
    assert tied.lm_head.weight is tied.tok_embed.weight
    assert tied.lm_head.weight.data_ptr() == tied.tok_embed.weight.data_ptr()
    assert untied.lm_head.weight.data_ptr() != untied.tok_embed.weight.data_ptr()
    ids = {id(p) for p in tied.parameters()}
    assert len(ids) == len(list(tied.parameters()))  # parameters() lists the shared weight once
    d, v = 32, 128
    assert untied.matmul_params() - tied.matmul_params() == 0  # the head is a matmul either way
    assert tied.matmul_params() == 2 * (4 * d * d + 2 * 4 * d * d) + v * d


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("positions", ["learned", "rotary"])
def test_padding_invariance(tie, positions):
    models = [build(seed=3, vocab_multiple=m, tie_embeddings=tie, positions=positions) for m in (1, 64)]
    assert [m.padded_vocab for m in models] == [VOCAB, 128]
    x, y = tokens(), tokens(seed=5)
    logits = [m(x) for m in models]
    torch.testing.assert_close(logits[0], logits[1][..., :VOCAB], rtol=0, atol=0)
    torch.testing.assert_close(models[0].criterion(logits[0], y), models[1].criterion(logits[1], y), rtol=0, atol=0)
    padded = models[1]
    assert padded.tok_embed.weight[VOCAB:].abs().sum() == 0
    assert padded.lm_head.weight[VOCAB:].abs().sum() == 0
    # The whole random stream is the same: every non-vocabulary weight is identical too.
    for (name, a), (_, b) in zip(models[0].named_parameters(), models[1].named_parameters()):
        torch.testing.assert_close(a, b[:a.shape[0]], rtol=0, atol=0, msg=name)


def test_criterion_masks_padded_columns():
    crit = CausalLMLoss(num_valid_vocab=5)
    logits = torch.randn(2, 3, 8, requires_grad=True)
    targets = torch.randint(0, 5, (2, 3))
    big = logits.detach().clone()
    big[..., 5:] = 1e4  # huge padded logits must not change anything
    expected = nn.functional.cross_entropy(logits[..., :5].flatten(0, 1), targets.flatten())
    torch.testing.assert_close(crit(logits, targets), expected)
    torch.testing.assert_close(crit(big, targets), expected)
    masked = logits.detach().clone()
    masked[..., 5:] = float("-inf")
    torch.testing.assert_close(nn.functional.cross_entropy(masked.flatten(0, 1), targets.flatten()), expected)
    crit(logits, targets).backward()
    assert logits.grad[..., 5:].abs().sum() == 0


def test_seq_len_check():
    cfg = small()
    check_seq_len(cfg, 16)
    with pytest.raises(ConfigError) as err:
        check_seq_len(cfg, 17)
    assert err.value.setting == "data.seq_len"
    with pytest.raises(ConfigError, match="data.seq_len"):
        build()(tokens(seq=17))


def test_generate_never_emits_padding():
    model = build(seed=4, tie_embeddings=False)
    with torch.no_grad():  # padded logits = sum(normalized + 1) = 32 beat every real logit (~0.01)
        model.norm.bias.fill_(1.0)
        model.lm_head.weight[:VOCAB] *= 0.5
        model.lm_head.weight[VOCAB:] = 1.0
        assert model(tokens())[..., VOCAB:].min() > model(tokens())[..., :VOCAB].max()
    model.train()
    out = greedy_decode(model, tokens(seq=10), 12, tp=SERIAL_TP)  # 22 > max_positions: context is cropped
    assert out.shape == (2, 22) and model.training
    assert int(out.max()) < VOCAB
    torch.testing.assert_close(out[:, :10], tokens(seq=10))


@pytest.mark.parametrize("prompt,new", [(5, 6), (10, 12)])
def test_greedy_decode_equals_unpadded_decoding(prompt, new):
    """The fixed-width, right-padded window gives the tokens of decoding on the bare (cropped) context."""
    model = build(seed=5).eval()
    out = greedy_decode(model, tokens(seq=prompt), new, tp=SERIAL_TP)
    ref = tokens(seq=prompt)
    with torch.no_grad():
        for _ in range(new):
            logits = model(ref[:, -model.cfg.max_positions:])[:, -1, :VOCAB]
            ref = torch.cat((ref, logits.argmax(dim=-1, keepdim=True)), dim=1)
    assert torch.equal(out, ref)


def test_padded_vocab_size():
    assert padded_vocab_size(100, 64) == 128
    assert padded_vocab_size(128, 64) == 128
    assert padded_vocab_size(50257, 64) == 50304
    assert padded_vocab_size(7, 1) == 7


@pytest.mark.parametrize("field,value", [
    ("embed_dim", 30), ("depth", 0), ("num_heads", 0), ("max_positions", 0), ("vocab_multiple", 0),
    ("dropout", 1.0), ("positions", "alibi"), ("init_std", 0.0), ("mlp_ratio", 0), ("arch", "vit")])
def test_config_errors(field, value):
    with pytest.raises(ConfigError) as err:
        small(**{field: value})
    assert err.value.setting == f"model.{field}"


def test_rotary_needs_even_head_dim():
    with pytest.raises(ConfigError, match="model.positions"):
        GPTConfig(embed_dim=12, num_heads=4, positions="rotary")


def test_rotary_scores_depend_only_on_relative_position():
    from networks.blocks import Attention, Rotary, apply_rotary

    attn = Attention(16, 2, causal=True, rotary=Rotary(32))
    q, k = torch.randn(8), torch.randn(8)

    def score(m, n):
        def rot(x, p):
            return apply_rotary(x.view(1, 1, 1, 8), attn.rotary_cos[p:p + 1], attn.rotary_sin[p:p + 1]).flatten()

        return (rot(q, m) * rot(k, n)).sum()

    torch.testing.assert_close(score(3, 1), score(20, 18))
    assert not torch.allclose(score(3, 1), score(3, 2))

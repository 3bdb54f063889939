"""remat on Hugging Face models built from a config (no weights downloaded): GPT-2 and BERT."""
import pytest
import torch

import remat

transformers = pytest.importorskip("transformers")

# The test's scalar loss is the model's own; this covers its gradient allocation.
LOSS_SLACK_BYTES = 64


def gpt2():
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=64,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def bert():
    cfg = transformers.BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=2,
                                  intermediate_size=128, vocab_size=128, max_position_embeddings=64)
    return transformers.BertForMaskedLM(cfg)


@pytest.mark.parametrize("build", [gpt2, bert], ids=["gpt2", "bert"])
def test_hf_model_exact_and_within_budget(build):
    ids = torch.randint(128, (4, 64), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    ref = build().train()
    torch.manual_seed(0)
    model = build().train()
    rm = remat.rematerialize(model, input_ids=ids, labels=ids, budget="65%", time_limit=20)
    assert list(rm.state_dict()) == list(ref.state_dict())
    torch.manual_seed(3)  # dropout: same random stream for both
    expected = ref(input_ids=ids, labels=ids)
    expected.loss.backward()
    torch.manual_seed(3)
    with remat.track_memory() as mem:
        out = rm(input_ids=ids, labels=ids)
        out.loss.backward()
    assert type(out) is type(expected)  # the ModelOutput pytree comes back as such
    assert torch.equal(out.loss, expected.loss) and torch.equal(out.logits, expected.logits)
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad)
    plan = rm.plan
    assert plan.predicted_step_ratio < 0.66  # of the eager step, measured
    assert mem.peak_bytes <= plan.budget_bytes + LOSS_SLACK_BYTES
    assert abs(mem.peak_bytes / plan.predicted_peak_bytes - 1) <= 0.05

"""remat on Hugging Face models built from a config (no weights downloaded): GPT-2, BERT and
Mixtral."""
import copy

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


def assert_bitwise_within(budget: str, ref, batch: int, seq: int) -> torch.nn.Module:
    """``rematerialize`` a copy of ``ref`` (an LM taking ``input_ids``/``labels``, vocabulary
    256) at ``budget``: the gradients of one step equal eager's bitwise and its measured peak
    keeps the budget. Returns the copy."""
    model = copy.deepcopy(ref)
    ids = torch.randint(256, (batch, seq), generator=torch.Generator().manual_seed(0))
    rm = remat.rematerialize(model, input_ids=ids, labels=ids, budget=budget)
    ref(input_ids=ids, labels=ids).loss.backward()
    with remat.track_memory() as mem:
        rm(input_ids=ids, labels=ids).loss.backward()
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad)
    assert mem.peak_bytes <= rm.plan.budget_bytes + LOSS_SLACK_BYTES
    return model


def mixtral(layers: int, experts: str):
    cfg = transformers.MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                     num_hidden_layers=layers, num_attention_heads=4,
                                     num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=128)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(cfg)
    model.set_experts_implementation(experts)
    return model


@pytest.mark.parametrize("experts", ["batched_mm", "grouped_mm"])
def test_mixtral_batched_experts_are_bitwise_where_eager_is_deterministic(experts):
    """Issue 34: Mixtral's ``batched_mm`` experts gave expert-weight gradients 7e-10 away from
    eager's. Eager's own differ that much from run to run: the gradient of
    ``gate_up_proj[expert_ids]`` is an accumulating ``index_put``, which on a multi-threaded CPU
    adds with atomic float adds in any order. Under ``torch.use_deterministic_algorithms(True)``
    eager adds serially, and so does the captured step: bitwise, within 50%. ``grouped_mm`` is
    what ``transformers`` picks by default."""
    torch.use_deterministic_algorithms(True)  # restored by conftest
    assert_bitwise_within("50%", mixtral(2, experts), batch=8, seq=64)


def qwen2_moe(layers: int, experts: str):
    cfg = transformers.Qwen2MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                      moe_intermediate_size=64,
                                      shared_expert_intermediate_size=128,
                                      num_hidden_layers=layers, num_attention_heads=4,
                                      num_key_value_heads=2, num_experts=4,
                                      num_experts_per_tok=2, max_position_embeddings=128)
    torch.manual_seed(0)
    model = transformers.Qwen2MoeForCausalLM(cfg)
    model.set_experts_implementation(experts)
    return model


@pytest.mark.parametrize("build", [mixtral, qwen2_moe], ids=["mixtral", "qwen2-moe"])
def test_eager_expert_loop_runs_as_one_op_as_eager_runs_it(build):
    """NOTE [ An expert loop as one op ]: the eager expert loop (routed sizes dynamo cannot
    trace: ``CaptureError`` before) is captured as one op that runs the layer's own loop, so
    every step, whatever the routing and at a new length, has eager's gradients bitwise
    (``grouped_mm`` was 5e-10 away) within 50%; the user's config reads "eager" afterwards.
    Qwen2-MoE's shared-expert gate reads the layer's input after the experts: 7e-9 away until
    each expert's gradient was added in eager's order (NOTE [ Each read's gradient in eager's
    order ])."""
    ref = build(4, "eager")
    model = copy.deepcopy(ref)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(256, (8, 64), generator=g)
    rm = remat.rematerialize(model, input_ids=ids, labels=ids, budget="50%")
    assert "4 experts layers ran as one op each" in rm.plan.summary()
    for shape in [(8, 64), (8, 64), (4, 100)]:  # new tokens route anew; then a new length
        ids = torch.randint(256, shape, generator=g)
        ref.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        with remat.track_memory() as eager:
            expected = ref(input_ids=ids, labels=ids).loss
            expected.backward()
        with remat.track_memory() as mem:
            loss = rm(input_ids=ids, labels=ids).loss
            loss.backward()
        assert torch.equal(loss, expected)
        for a, b in zip(ref.parameters(), model.parameters()):
            assert torch.equal(a.grad, b.grad)
        assert mem.peak_bytes <= 0.50 * eager.peak_bytes
    assert model.config._experts_implementation == "eager"


def mamba(layers: int):
    """A small HF Mamba built from its config (the tests' own seed)."""
    cfg = transformers.MambaConfig(vocab_size=256, hidden_size=64, state_size=8,
                                   num_hidden_layers=layers, use_cache=False)
    torch.manual_seed(0)
    return transformers.MambaForCausalLM(cfg)


def test_hf_mamba_is_captured_as_eager_runs_it():
    """NOTE [ The algorithm eager runs ]: HF Mamba's mixers run ``associative_scan`` when they
    see dynamo (``use_associative_scan``, on by default) and a sequential loop in eager; the
    captured step is eager's loop: bitwise gradients, within 50% (issue 34; with 2 layers the
    lowest schedule is 52% of eager's step at T=32, where the scan's own gradients fill most of
    the budget), and the user's flag is left as it was."""
    ref = mamba(3)
    assert ref.config.use_associative_scan
    model = assert_bitwise_within("50%", ref, batch=4, seq=16)
    mixers = [m for m in model.modules() if hasattr(m, "use_associative_scan")]
    assert len(mixers) == 3 and all(m.use_associative_scan is True for m in mixers)


def test_hf_mamba_reaches_the_floor_that_keeping_each_layers_input_reaches():
    """Issue 34 item 3: a 2-layer HF Mamba's lowest schedule was 55-59% of eager's step
    (``InfeasibleBudgetError`` advising "56%"), where keeping each layer's input and recomputing
    the rest before each read peaks at 52%. Two causes: the layers' scans (modules held in
    globals, NOTE [ Modules held in globals ]) shared one module path outside the layers, and
    the rescue kept nothing (NOTE [ Least memory within blocks ]). "52%" now fits, bitwise."""
    ref = mamba(2)
    model = copy.deepcopy(ref)
    ids = torch.randint(256, (4, 32), generator=torch.Generator().manual_seed(0))
    rm = remat.rematerialize(model, input_ids=ids, labels=ids, budget="52%")
    with remat.track_memory() as eager:
        ref(input_ids=ids, labels=ids).loss.backward()
    with remat.track_memory() as mem:
        rm(input_ids=ids, labels=ids).loss.backward()
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad)
    assert mem.peak_bytes <= 0.52 * eager.peak_bytes
    assert "least memory, the inputs of 4 blocks kept" in rm.plan.summary()


def test_a_longer_sequence_than_the_example_gets_its_own_share():
    """NOTE [ Budgets over many sizes ]: HF Mamba's scan loops over the sequence, so dynamo
    captures each length as a graph of its own. A longer one is the run's largest step, and
    "60%" is of it: it used to get the example's smaller budget in bytes, which no schedule
    could meet, and ran a nearly unmodified step at 1.06x its eager peak."""
    ref = mamba(2)
    model = copy.deepcopy(ref)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(256, (4, 32), generator=g)
    rm = remat.rematerialize(model, input_ids=ids, labels=ids, budget="60%")
    longer = torch.randint(256, (4, 48), generator=g)
    with remat.track_memory() as eager:
        ref(input_ids=longer, labels=longer).loss.backward()
    rm(input_ids=longer, labels=longer).loss.backward()  # captures and solves this length
    model.zero_grad(set_to_none=True)
    with remat.track_memory() as mem:
        rm(input_ids=longer, labels=longer).loss.backward()
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad)
    assert mem.peak_bytes <= 0.60 * eager.peak_bytes
    # NOTE [ A specialisation the eager step fits ]: a shorter length, whose unmodified step
    # fits the run's budget, runs as eager does from the step that captures it (1.12x before).
    shorter = torch.randint(256, (4, 24), generator=g)
    ref.zero_grad(set_to_none=True)
    model.zero_grad(set_to_none=True)
    with remat.track_memory() as eager:
        ref(input_ids=shorter, labels=shorter).loss.backward()
    with remat.track_memory() as mem:
        rm(input_ids=shorter, labels=shorter).loss.backward()
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad)
    assert mem.peak_bytes <= eager.peak_bytes + LOSS_SLACK_BYTES

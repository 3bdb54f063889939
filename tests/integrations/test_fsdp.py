"""HiRemate inside FSDP2 units (``integrations/_fsdp.py``): one budget for the whole step.

The scenario runs in a fresh process (it owns a gloo process group) with FSDP2 on one CPU rank:
``fully_shard`` wraps each decoder layer of a Hugging Face Llama built from a config, then the
root, as users shard it.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

SCENARIO = textwrap.dedent("""
    import dataclasses, json, os, socket, sys
    import torch, torch.distributed as dist
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    import transformers
    import remat
    from integrations import _fsdp, _fsdp_peak
    from integrations._remat_shared import Target
    from integrations._warmup import preserved_state, record_first_calls

    mesh = init_device_mesh("cpu", (1,))
    ids = torch.randint(1000, (4, 64), generator=torch.Generator().manual_seed(1))

    def build():
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(num_hidden_layers=4, hidden_size=128, num_attention_heads=4,
                                       num_key_value_heads=4, intermediate_size=344,
                                       vocab_size=1000, max_position_embeddings=128,
                                       attn_implementation="sdpa")
        model = transformers.LlamaForCausalLM(cfg)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    def loss_of(model):
        return model(input_ids=ids, labels=ids, use_cache=False).loss

    def train(model, steps):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses, peaks, grads = [], [], None
        for _ in range(steps):
            with remat.track_memory() as mem:
                loss = loss_of(model)
                loss.backward()
            if grads is None:
                grads = [p.grad.full_tensor().clone() for p in model.parameters()]
            opt.step(); opt.zero_grad(set_to_none=True)
            losses.append(loss.item()); peaks.append(mem.peak_bytes)
        return losses, peaks, grads

    eager_losses, eager_peaks, eager_grads = train(build(), 3)

    model = build()
    keys = list(model.state_dict())
    roots, units = _fsdp.fsdp_units(model)
    targets = [Target(name, None, "", unit, False) for name, unit in units]
    with preserved_state(model), record_first_calls(targets) as calls, \\
            _fsdp_peak.step_phases([u for _, u in units]) as phases, remat.track_memory() as warmup:
        loss_of(model).backward()

    def trial():
        with preserved_state(model), remat.track_memory() as mem:
            loss_of(model).backward()
        return mem.peak_bytes

    fraction = float(sys.argv[1])
    plans = _fsdp.plan_units([u for _, u in units], [calls[n] for n, _ in units],
                             warmup.peak_bytes, int(fraction * warmup.peak_bytes),
                             solver="hierarchical", time_limit=60, cache=remat.PlanCache(),
                             trial=trial, phases=phases.measured)
    losses, peaks, grads = train(model, 3)
    model.eval()  # reaches the units, which hand it to their rematerialized forwards
    with torch.no_grad():
        loss_of(model)
    eval_follows = all(not rm.training and not rm.original.training for rm in plans.modules)
    model.train()
    same_keys = list(model.state_dict()) == keys
    for _, unit in units:
        _fsdp.uninstall(unit)
    print(json.dumps({
        "roots": [n for n, _ in roots], "units": [n for n, _ in units],
        "eager_losses": eager_losses, "losses": losses,
        "grads_equal": all(torch.equal(a, b) for a, b in zip(eager_grads, grads)),
        "eager_peaks": eager_peaks, "peaks": peaks, "warmup": warmup.peak_bytes,
        "budget": plans.budget_bytes, "measured": plans.measured_step_bytes,
        "predicted": plans.share.predicted_step_bytes, "fraction": plans.share.fraction,
        "checkpointed": plans.share.checkpointed, "rounds": plans.rounds,
        "phases": list(dataclasses.astuple(phases.measured)),
        "same_keys": same_keys, "restored": all("forward" not in u.__dict__ for _, u in units),
        "eval_follows": eval_follows,
    }))
    dist.destroy_process_group()
""")


def run_scenario(fraction: float) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, "-c", SCENARIO, str(fraction)], capture_output=True,
                          text=True, timeout=900, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(900)
def test_every_fsdp2_unit_is_rematerialized_under_one_step_budget():
    """NOTE [ Remat inside an FSDP unit ], NOTE [ One step budget over FSDP units ]: at half the
    step, the units' own schedules alone cannot get there (each stops near half of its own
    step), so units keep only their inputs and run again in backward; the measured step fits,
    every loss and gradient is FSDP2's own, bit for bit, and nothing in the module tree changed."""
    pytest.importorskip("transformers")
    out = run_scenario(0.5)
    assert out["roots"] == [""] and out["units"] == [f"model.layers.{k}" for k in range(4)]
    assert out["losses"] == out["eager_losses"] and out["grads_equal"]
    assert out["same_keys"] and out["restored"] and out["eval_follows"]
    assert out["checkpointed"] >= 1  # the units' own schedules do not reach half the step
    assert out["measured"] <= out["budget"]
    # NOTE [ The step's peak over a chain of units ]: the warmup step cut in three (the loss
    # head peaks here), and the plans' step predicted from 2% under to 8% over what it
    # measured (4.7% over when written: the units' own schedules predict their peaks high)
    forward, units, tail = out["phases"]
    assert max(forward, units, tail) == out["warmup"] and tail < units < forward, out["phases"]
    assert -0.02 <= out["predicted"] / out["measured"] - 1 <= 0.08, out
    eager = max(out["eager_peaks"])
    assert max(out["peaks"]) <= 0.5 * eager * 1.02, (out["peaks"], eager)


LIGHTNING = textwrap.dedent("""
    import json, sys
    import torch, transformers, lightning as L
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    import remat
    from integrations.lightning import HiRemateCallback

    class LM(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            if MODEL == "llama":
                cfg = transformers.LlamaConfig(
                    num_hidden_layers=4, hidden_size=128, num_attention_heads=4,
                    num_key_value_heads=4, intermediate_size=344, vocab_size=1000,
                    max_position_embeddings=128, attn_implementation="sdpa")
                self.m = transformers.LlamaForCausalLM(cfg)
                self.layers = self.m.model.layers
            else:  # GPT-2: its default dropout 0.1 on
                cfg = transformers.GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=1000,
                                              n_positions=128, attn_implementation="sdpa")
                self.m = transformers.GPT2LMHeadModel(cfg)
                self.layers = self.m.transformer.h

        def configure_model(self):  # FSDP2 as users shard: each decoder layer, then the root
            options = {"mesh": self.device_mesh["data_parallel"], "reshard_after_forward": RESHARD}
            if BF16:
                options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                            reduce_dtype=torch.float32)
            for layer in self.layers:
                fully_shard(layer, **options)
            fully_shard(self.m, **options)

        def training_step(self, batch, i):
            return self.m(input_ids=batch, labels=batch, use_cache=False).loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):  # a DistributedSampler: each rank its own batches
            if PADDING:  # lengths 16-95, each batch padded to its longest
                ids = [torch.randint(1, 1000, (16 + (37 * k) % 80,),
                                     generator=torch.Generator().manual_seed(k))
                       for k in range(96)]
                pad = lambda b: torch.nn.utils.rnn.pad_sequence(b, batch_first=True)
                return torch.utils.data.DataLoader(ids, batch_size=4, collate_fn=pad)
            ids = [torch.randint(0, 1000, (64,), generator=torch.Generator().manual_seed(k))
                   for k in range(64)]
            return torch.utils.data.DataLoader(ids, batch_size=4)

    class Watch(L.Callback):  # every training step's loss and measured peak
        def __init__(self):
            self.losses, self.peaks, self.shapes = [], [], []
        def on_train_batch_start(self, trainer, pl_module, batch, i):
            self.meter = remat.track_memory()
            self.memory = self.meter.__enter__()
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            self.meter.__exit__(None, None, None)
            self.peaks.append(self.memory.peak_bytes)
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, i):
            self.losses.append(outputs["loss"].item())
            self.shapes.append(list(batch.shape))

    budget, PADDING, steps = sys.argv[1], sys.argv[2] == "padding", int(sys.argv[3])
    MODEL, BF16, RESHARD = sys.argv[4], sys.argv[5] == "bf16", sys.argv[6] == "reshard"
    watch = Watch()
    callbacks = [watch] if budget == "none" else [HiRemateCallback(budget, verbose=False), watch]
    trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=steps, logger=False,
                        strategy=ModelParallelStrategy(data_parallel_size=2,
                                                       tensor_parallel_size=1),
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=callbacks)
    trainer.fit(LM())
    warmup = callbacks[0].eager_peak_bytes if budget != "none" else None
    print("RESULT " + json.dumps({"rank": trainer.global_rank, "losses": watch.losses,
                                  "peaks": watch.peaks, "shapes": watch.shapes,
                                  "warmup": warmup}), flush=True)
""")


def fit_fsdp2(tmp_path: Path, budget: str, data: str = "fixed", steps: int = 5, *,
              model: str = "llama", bf16: bool = False, reshard: bool = True
              ) -> dict[int, dict]:
    """``LIGHTNING`` on 2 CPU ranks; ``bf16``: ``MixedPrecisionPolicy(param_dtype=bfloat16,
    reduce_dtype=float32)``; ``reshard``: ``reshard_after_forward``."""
    return run_ranks(tmp_path, "fit_fsdp2.py", LIGHTNING,
                     [budget, data, str(steps), model, "bf16" if bf16 else "fp32",
                      "reshard" if reshard else "keep"])


def run_ranks(tmp_path: Path, name: str, source: str, argv: list[str], *,
              launcher: tuple[str, ...] = (), env: dict[str, str] | None = None
              ) -> dict[int, dict]:
    """Run ``source`` as a script (under ``launcher``, with ``env`` if given) and collect each
    rank's ``RESULT`` line."""
    script = tmp_path / name
    script.write_text(source)
    full = dict(os.environ if env is None else env)  # ``env``: instead of this process's
    full.update(PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, *launcher, str(script), *argv], capture_output=True,
                          text=True, timeout=1800, env=full, cwd=tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    # each rank prints its line in one write, but torchrun's relay may join two on one line
    text, decoder = proc.stdout + proc.stderr, json.JSONDecoder()
    results = [decoder.raw_decode(chunk)[0] for chunk in text.split("RESULT ")[1:]]
    return {r["rank"]: r for r in results}


def assert_half_of_plain(ours: dict[int, dict], plain: dict[int, dict], *, steps: int) -> None:
    """Every rank ran ``steps`` steps with the same losses as without remat, bit for bit, and
    each step at most half of the same run's largest step without remat (2% for the
    measurement)."""
    assert sorted(plain) == sorted(ours) == [0, 1]
    for rank in (0, 1):
        assert ours[rank]["losses"] == plain[rank]["losses"]
        assert len(ours[rank]["losses"]) == steps
        eager = max(plain[rank]["peaks"])
        assert max(ours[rank]["peaks"]) <= 0.5 * eager * 1.02, (rank, ours[rank]["peaks"], eager)


@pytest.mark.timeout(900)
def test_lightning_fsdp2_keeps_every_ranks_step_under_the_budget(tmp_path):
    """Issue 33: ``HiRemateCallback(budget="50%")`` under ``ModelParallelStrategy`` on 2 CPU
    ranks (gloo), each rank on its own batches: every step of every rank measures at most half
    of the same FSDP2 run's step without remat (2% for the measurement), with the same losses,
    bit for bit. (Before NOTE [ Frees in other threads ], gloo's unrecorded frees made the
    same plans read 6.84-8.42 MB from step to step.)"""
    pytest.importorskip("transformers")
    plain, ours = fit_fsdp2(tmp_path, "none"), fit_fsdp2(tmp_path, "50%")
    assert_half_of_plain(ours, plain, steps=5)
    assert plain[0]["losses"] != plain[1]["losses"]  # the ranks did see different batches


@pytest.mark.timeout(900)
def test_lightning_fsdp2_gpt2_in_bf16_with_unsharded_parameters_kept_after_forward(tmp_path):
    """Issue 33 items 1 and 3: an HF GPT-2 (dropout on) sharded with
    ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` and
    ``reshard_after_forward=False`` (the parameters stay gathered from forward to backward):
    every step of every rank at most half of the same FSDP2 run's without remat, the losses
    bit for bit (bf16 dropout: NOTE [ Eager dropout in half precision on CPU ])."""
    pytest.importorskip("transformers")
    plain = fit_fsdp2(tmp_path, "none", steps=4, model="gpt2", bf16=True, reshard=False)
    ours = fit_fsdp2(tmp_path, "50%", steps=4, model="gpt2", bf16=True, reshard=False)
    assert_half_of_plain(ours, plain, steps=4)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_lightning_fsdp2_with_bf16_mixed_precision(tmp_path):
    """Issue 33 item 3: ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` on
    the Llama: the units run in bf16 and reduce in fp32; every step at most half of the same
    FSDP2 run's, the losses bit for bit."""
    pytest.importorskip("transformers")
    plain = fit_fsdp2(tmp_path, "none", steps=4, bf16=True)
    ours = fit_fsdp2(tmp_path, "50%", steps=4, bf16=True)
    assert_half_of_plain(ours, plain, steps=4)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_lightning_fsdp2_with_dynamic_padding_on_ranks_seeing_different_shapes(tmp_path):
    """Issue 33: 20 steps of batches padded to their longest (16-95 tokens), the two ranks
    seeing different lengths on the same step: every step of every rank measures at most half of
    the warmup step that rank measured (the budget's reference; 2% for FSDP's jitter), losses
    bit for bit. Slow (~7 min on 2 busy cores): each unit meets new sizes inside training and
    plans them on its own rank. Measured: every step at most 0.383 of its rank's warmup step
    with the units captured static first (the default), 0.427 captured dynamic at once."""
    pytest.importorskip("transformers")
    plain = fit_fsdp2(tmp_path, "none", "padding", 20)
    ours = fit_fsdp2(tmp_path, "50%", "padding", 20)
    assert any(a != b for a, b in zip(plain[0]["shapes"], plain[1]["shapes"]))
    for rank in (0, 1):
        assert ours[rank]["shapes"] == plain[rank]["shapes"]
        assert ours[rank]["losses"] == plain[rank]["losses"]
        assert len(ours[rank]["losses"]) == 20
        # the budget: half of the warmup step this rank measured (its first batch's shapes)
        assert max(ours[rank]["peaks"]) <= 0.5 * ours[rank]["warmup"] * 1.02


RESUME = textwrap.dedent("""
    import json, sys
    import torch, transformers, lightning as L
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard
    from integrations.lightning import HiRemateCallback

    class LM(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            cfg = transformers.LlamaConfig(num_hidden_layers=4, hidden_size=128,
                                           num_attention_heads=4, num_key_value_heads=4,
                                           intermediate_size=344, vocab_size=1000,
                                           max_position_embeddings=128, attn_implementation="sdpa")
            self.m = transformers.LlamaForCausalLM(cfg)

        def configure_model(self):
            mesh = self.device_mesh["data_parallel"]
            for layer in self.m.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(self.m, mesh=mesh)

        def training_step(self, batch, i):
            return self.m(input_ids=batch, labels=batch, use_cache=False).loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):  # 3 batches per rank per epoch
            ids = [torch.randint(0, 1000, (64,), generator=torch.Generator().manual_seed(k))
                   for k in range(24)]
            return torch.utils.data.DataLoader(ids, batch_size=4)

    class Losses(L.Callback):
        def __init__(self):
            self.losses = []
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, i):
            self.losses.append(outputs["loss"].item())

    mode, steps, path, remat = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    losses, model = Losses(), LM()
    callbacks = [HiRemateCallback("50%", verbose=False)] if remat == "remat" else []
    trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=steps, logger=False,
                        strategy=ModelParallelStrategy(data_parallel_size=2,
                                                       tensor_parallel_size=1),
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False,
                        callbacks=[*callbacks, losses])
    trainer.fit(model, ckpt_path=path if mode == "resume" else None)
    if mode == "save":
        trainer.save_checkpoint(path)  # a distributed checkpoint: a directory of shards
    print("RESULT " + json.dumps({"rank": trainer.global_rank, "losses": losses.losses,
                                  "keys": sorted(model.state_dict())}), flush=True)
""")


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_lightning_fsdp2_resumes_from_a_distributed_checkpoint(tmp_path):
    """Issue 33 item 4: ``trainer.save_checkpoint`` after one epoch (3 steps) under
    ``HiRemateCallback``, then a new run with ``ckpt_path``: the checkpoint is a directory of
    shards with the user's own state_dict keys, and the resumed run (which plans again) gives
    the losses Lightning gives without remat, bit for bit. Known: without remat too, the
    resumed run's second step differs from an uninterrupted run's (SGD and AdamW alike; the
    first resumed step matches, so the weights come back): a Lightning resume behaviour on
    this setup, see the issue 33 note."""
    pytest.importorskip("transformers")
    runs = {}
    for callbacks in ("remat", "plain"):
        path = str(tmp_path / f"{callbacks}.ckpt")
        saved = run_ranks(tmp_path, "resume.py", RESUME, ["save", "3", path, callbacks])
        resumed = run_ranks(tmp_path, "resume.py", RESUME, ["resume", "6", path, callbacks])
        assert (tmp_path / f"{callbacks}.ckpt").is_dir()
        runs[callbacks] = saved, resumed
    for rank in (0, 1):
        for ours, plain in zip(runs["remat"], runs["plain"]):
            assert ours[rank]["losses"] == plain[rank]["losses"] and ours[rank]["losses"]
            assert ours[rank]["keys"] == plain[rank]["keys"]
            assert all(k.startswith("m.") and "_orig_mod" not in k and "original" not in k
                       for k in ours[rank]["keys"])


ACCELERATE = textwrap.dedent('''
import json, os, sys
import torch, transformers
from accelerate import Accelerator
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
import remat
from integrations.accelerate import rematerialize_for_accelerate

steps = int(sys.argv[1])
accelerator = Accelerator(cpu=True)
rank, world = accelerator.process_index, accelerator.num_processes
mesh = init_device_mesh("cpu", (world,))
torch.manual_seed(0)
cfg = transformers.LlamaConfig(num_hidden_layers=4, hidden_size=128, num_attention_heads=4,
                               num_key_value_heads=4, intermediate_size=344, vocab_size=1000,
                               max_position_embeddings=128, attn_implementation="sdpa")
model = transformers.LlamaForCausalLM(cfg)
for layer in model.model.layers:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
keys = list(model.state_dict())
batches = [{"input_ids": ids, "labels": ids, "use_cache": False} for ids in
           (torch.randint(1000, (4, 64), generator=torch.Generator().manual_seed(100 * rank + k))
            for k in range(steps))]
model = rematerialize_for_accelerate(accelerator, model, batches[0])  # HIREMATE_* from the env
opt = torch.optim.SGD(model.parameters(), lr=0.1)
losses, peaks = [], []
for batch in batches:
    with remat.track_memory() as mem:
        loss = model(**batch).loss
        loss.backward()
    opt.step(); opt.zero_grad(set_to_none=True)
    losses.append(loss.item()); peaks.append(mem.peak_bytes)
print("RESULT " + json.dumps({"rank": rank, "losses": losses, "peaks": peaks,
                              "same_keys": list(model.state_dict()) == keys,
                              "type": type(model).__name__}), flush=True)
''')


def launch_accelerate(tmp_path: Path, budget: str, steps: int = 4) -> dict[int, dict]:
    """The script under ``torchrun`` (2 CPU processes, gloo), FSDP2 sharded by hand (NOTE
    [ FSDP2 under Accelerate ]), settings from ``HIREMATE_*`` as ``accelerate launch`` passes
    them."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HIREMATE_")}
    env["HIREMATE_CACHE_DIR"] = "off"
    if budget:
        env["HIREMATE_BUDGET"] = budget
    return run_ranks(tmp_path, "train_accelerate.py", ACCELERATE, [str(steps)], env=env,
                     launcher=("-m", "torch.distributed.run", "--standalone",
                               "--nproc_per_node", "2"))


@pytest.mark.timeout(1200)
def test_accelerate_fsdp2_under_torchrun_keeps_every_ranks_step_under_the_budget(tmp_path):
    """Issue 33 item 2: ``HIREMATE_BUDGET=50%`` and ``rematerialize_for_accelerate`` on an FSDP2
    model (each decoder layer, then the root) on 2 ranks: the losses bit for bit, the model
    still FSDP's with its own state_dict keys, every step of every rank near half of the same
    run's without remat."""
    pytest.importorskip("transformers")
    plain, ours = launch_accelerate(tmp_path, ""), launch_accelerate(tmp_path, "50%")
    assert sorted(plain) == sorted(ours) == [0, 1]
    for rank in (0, 1):
        assert ours[rank]["losses"] == plain[rank]["losses"]
        assert ours[rank]["same_keys"] and ours[rank]["type"] == "FSDPLlamaForCausalLM"
        eager = max(plain[rank]["peaks"])
        assert max(ours[rank]["peaks"]) <= 0.5 * eager * 1.02, (rank, ours[rank]["peaks"], eager)
    assert plain[0]["losses"] != plain[1]["losses"]


def test_a_model_without_fsdp2_units_is_unplannable_with_the_fix():
    """The callback and the plugin say what to call (then train unmodified, or raise when
    strict) when the model holds no ``fully_shard`` unit."""
    import torch.nn as nn

    from integrations._fsdp import Unplannable, units_to_plan

    with pytest.raises(Unplannable, match=r"Sequential has no fully_shard module"):
        units_to_plan(nn.Sequential(nn.Linear(2, 2)))


CACHED = textwrap.dedent("""
    import socket, sys
    import torch, torch.distributed as dist, transformers
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    import remat
    from integrations._fsdp import Unplannable, rematerialize_fsdp2
    from integrations._remat_shared import check_settings

    mesh = init_device_mesh("cpu", (1,))
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                   num_key_value_heads=4, intermediate_size=128, vocab_size=100,
                                   max_position_embeddings=64, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(cfg)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    ids = torch.randint(100, (2, 16))

    def step(warmup):  # the training call as written without use_cache=False
        with remat.track_memory() as mem:
            model(input_ids=ids, labels=ids).loss.backward()
        return mem.peak_bytes

    settings = check_settings(budget="50%", solver=remat.DEFAULT_SOLVER, time_limit=10,
                              module=None, cache_dir=None, strict=True, verbose=False)
    try:
        rematerialize_fsdp2(model, step, settings, remat.PlanCache(), owner="test")
    except Unplannable as e:
        print("REFUSED", e)
    print("RESTORED", all("forward" not in l.__dict__ for l in model.model.layers))
    dist.destroy_process_group()
""")


@pytest.mark.timeout(300)
def test_a_hugging_face_cache_in_the_units_calls_is_refused_with_the_fix():
    """A training call without ``use_cache=False`` hands each decoder layer the model's
    ``DynamicCache``, which a unit's graph cannot take: the units are refused naming the fix,
    before any capture, and keep their own forwards (the callback then trains unmodified, or
    raises when strict)."""
    pytest.importorskip("transformers")
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, "-c", CACHED], capture_output=True, text=True,
                          timeout=280, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert ("REFUSED the training step hands the FSDP units model.layers.0, model.layers.1 "
            "a Hugging Face cache (past_key_values)") in proc.stdout
    assert "pass use_cache=False in the training call" in proc.stdout
    assert "RESTORED True" in proc.stdout


@pytest.mark.parametrize("forward_s, expected", [(0.4, (1.0, 2)), (0.8, (0.75, 0))])
def test_the_step_budget_goes_to_the_fastest_split_between_checkpointing_and_remat(
        monkeypatch, forward_s, expected):
    """NOTE [ Checkpointing more units can be faster ]: two units whose own schedules cost
    ``2 * (1 - f)`` of their step at a fraction ``f``; a checkpointed unit runs its forward
    (``forward_s``) once more. Under 150 of a 200-byte step, either both units are checkpointed
    with no remat inside (2 + 2 * forward_s seconds) or none, each at 75% of its step (3 s)."""
    from types import SimpleNamespace

    import integrations._fsdp as fsdp
    from remat.graph import Phase

    monkeypatch.setattr(fsdp, "costs_key", lambda graph: "unit")

    def plan_for(fraction, *, solver):
        peak = max(60.0, 100 * fraction)
        return SimpleNamespace(predicted_peak_bytes=peak, saved_bytes=peak - 20,
                               baseline_time_s=1.0, predicted_overhead=2 * (1 - fraction))

    graph = SimpleNamespace(ops=[SimpleNamespace(phase=Phase.FORWARD, time=forward_s),
                                 SimpleNamespace(phase=Phase.BACKWARD, time=0.6)])
    unit = SimpleNamespace(graphs=[graph], plan=SimpleNamespace(baseline_bytes=100, saved_bytes=80),
                           plan_for=plan_for)
    share = fsdp.share_step_budget([unit, unit], [10, 10], 200, 150, solver="dp")
    assert (share.fraction, share.checkpointed) == expected and share.fits
    assert share.predicted_step_bytes <= 150


def test_the_step_model_orders_the_units_and_puts_the_loss_head_in_the_forward_phase():
    """NOTE [ The step's peak over a chain of units ]: calibrated on the unmodified units, each
    phase predicts its measured peak; a unit's backward sees only the units before it holding
    what they saved, and the loss head sees all of them."""
    from integrations._fsdp_peak import StepModel, StepPhases

    eager = [(100, 80), (100, 80), (100, 80)]  # (peak, saved) of each unit, in forward order
    # backward: the last unit runs while the first two hold 160: 160 + 100 + rest 40
    model = StepModel.calibrated(eager, 300, StepPhases(forward_bytes=290, backward_bytes=300))
    assert (model.forward_rest, model.backward_rest) == (50, 40)
    assert model(eager) == 300
    # the first unit saving less lowers both phases; the last one only the loss head's
    assert model([(60, 40), (100, 80), (100, 80)]) == max(50 + 200, 40 + 40 + 80 + 100)
    assert model([(100, 80), (100, 80), (60, 40)]) == max(50 + 200, 40 + 160 + 60, 40 + 80 + 100)
    # without phases: every unit's saved values held while the largest extra runs
    loose = StepModel.calibrated(eager, 300, None)
    assert loose.forward_rest is None and loose(eager) == 300
    assert loose([(100, 80), (100, 80), (60, 40)]) == 300 - 40
    # a unit's gradients: 10 kept (its shard) from its backward on, 30 (unsharded) while the
    # unit before it runs its backward; with the first two units holding little, the first
    # unit's backward peaks; the embedding's backward after the units (tail 120) sets a floor
    graded = StepModel.calibrated(eager, 300, StepPhases(290, 300, tail_bytes=120), ((10, 30),) * 3)
    assert graded.backward_rest == 40 and graded(eager) == 300
    assert graded([(100, 0), (100, 0), (100, 80)]) == max(50 + 80, 40 + 100 + 20 + 30, 120)
    assert graded([(10, 0), (10, 0), (10, 0)]) == 120


def test_the_phases_split_the_measured_step_where_the_units_backward_starts():
    """``step_phases`` on a chain of units then a loss head 8x wider: the forward phase (every
    unit's saved values and the head's logits) peaks above the units' backward, which peaks
    above what follows the first unit, and the phases' peaks make the step's."""
    import torch
    from torch import nn

    import remat
    from integrations._fsdp_peak import step_phases

    torch.manual_seed(0)
    units = [nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(3)]
    head = nn.Linear(64, 512)
    x = torch.randn(32, 64, requires_grad=True)  # as an embedding's output
    with step_phases(units) as phases, remat.track_memory() as memory:
        h = x
        for unit in units:
            h = unit(h)
        head(h).logsumexp(-1).sum().backward()
    measured = phases.measured
    assert measured is not None
    assert max(measured.forward_bytes, measured.backward_bytes, measured.tail_bytes) \
        == memory.peak_bytes
    logits = 32 * 512 * 4
    assert measured.forward_bytes >= logits + 3 * 32 * 64 * 4  # the logits and each unit's tanh
    assert measured.backward_bytes < measured.forward_bytes
    assert measured.tail_bytes < measured.backward_bytes
    assert len(memory.marks) == 6  # where the gradient reaches each unit's output and input
    with step_phases(units) as unmeasured:  # no track_memory block: nothing to cut
        units[0](x).sum().backward()
    assert unmeasured.measured is None

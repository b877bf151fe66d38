"""What a first GPU node would meet, checked on the CPU with the device calls stubbed (REVIEW D, docs/doctor.md).

GPU identity from device properties (per-task binding: every rank's GPU is cuda:0), the GPU model and its peak
from name, memory and SMs, causal attention counted half, bandwidth verdicts against the achievable fraction of
a link, the device-agnostic synchronize and free_memory, the collective bench's timer, the doctor's single-device
comparison (memory freed first, no rank held in a collective), and the local launcher refusing to put ranks on
the CPU when there are GPUs but fewer than ranks.
"""

from __future__ import annotations

import weakref
import zlib
from types import SimpleNamespace

import pytest
import torch

from distributed import device as device_mod
from utils import ConfigError
from utils.bench import collectives as bench_collectives
from utils.cli import local_launch
from utils.comm import AxisGroup
from utils.doctor import bandwidth, environment, training
from utils.engine import flops

GIB = 2**30


def _props(name="NVIDIA H100 80GB HBM3", memory_gib=79.6, sms=132, uuid="GPU-1111", bus=0x18):
    return SimpleNamespace(name=name, total_memory=int(memory_gib * GIB), multi_processor_count=sms, uuid=uuid,
                           pci_bus_id=bus, pci_domain_id=0, pci_device_id=0, major=9, minor=0)


@pytest.fixture
def one_gpu(monkeypatch):
    """A CPU machine made to answer like one H100 per process: the properties `props` holds."""
    props = {"now": _props()}
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props["now"])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: props["now"].name)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    return props


def test_gpu_identity_is_the_uuid_or_the_pci_bus_never_the_index(one_gpu):
    cuda0 = torch.device("cuda", 0)
    assert device_mod.gpu_identity(cuda0) == "uuid:GPU-1111"
    one_gpu["now"] = _props(uuid=None, bus=0x3B)
    assert device_mod.gpu_identity(cuda0) == "pci:0:59:0"
    assert device_mod.gpu_identity(torch.device("cpu")) == "cpu"


def test_per_task_binding_is_not_a_shared_gpu(one_gpu, monkeypatch):
    """Two ranks on one node, each bound to its own GPU that it sees as cuda:0: distinct placements; two
    ranks given the same GPU: one shared."""
    grid = SimpleNamespace(device=torch.device("cpu"), world_size=1)  # the gather itself is a collective
    placements = []
    for uuid in ("GPU-aaaa", "GPU-bbbb", "GPU-aaaa"):
        one_gpu["now"] = _props(uuid=uuid)
        facts = environment.device_facts(torch.device("cuda", 0))
        assert facts["index"] == 0 and facts["identity"] == f"uuid:{uuid}"
        monkeypatch.setattr(environment, "device_facts", lambda device, facts=facts: facts)
        placements += environment.node_of_every_rank(grid)
        monkeypatch.undo()
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: one_gpu["now"])
    assert placements[0][1] == zlib.crc32(b"uuid:GPU-aaaa")
    assert environment.shared_gpus(placements[:2]) == 0
    assert environment.shared_gpus(placements) == 1


@pytest.mark.parametrize("name, memory, sms, model", [
    ("NVIDIA H100 80GB HBM3", 79.6, 132, "H100"), ("NVIDIA H100 NVL", 93.1, 132, "H100 NVL"),
    ("NVIDIA H100 PCIe", 79.6, 114, "H100 PCIe"), ("NVIDIA H100", 79.6, 114, "H100 PCIe"),
    ("NVIDIA H100", 93.1, 132, "H100 NVL"), ("NVIDIA H200", 139.8, 132, "H200"),
    ("NVIDIA H200 NVL", 139.8, 132, "H200 NVL"), ("NVIDIA GH200 480GB", 94.5, 132, "GH200"),
    ("NVIDIA A100-SXM4-80GB", 79.2, 108, "A100"), ("Tesla V100-SXM2-32GB", 31.7, 80, None)])
def test_gpu_model_from_name_memory_and_sms(name, memory, sms, model):
    assert flops.gpu_model(name, memory, sms) == model


def test_peak_read_from_the_device_properties(one_gpu):
    cuda0 = torch.device("cuda", 0)
    assert flops.peak_tflops(cuda0, "bf16") == 989.0
    one_gpu["now"] = _props(name="NVIDIA H100 NVL", memory_gib=93.1)
    assert flops.peak_tflops(cuda0, "bf16") == 835.5 and flops.mfu(83.55, cuda0, "bf16") == pytest.approx(0.1)
    one_gpu["now"] = _props(name="Tesla T4", memory_gib=14.6, sms=40)
    assert flops.peak_tflops(cuda0, "bf16") is None and flops.peak_tflops(torch.device("cpu"), "bf16") is None


def test_causal_attention_counts_half():
    tokens, params, depth, width = 1024, 10_000, 4, 64
    full = flops.training_flops_per_sample(tokens, params, depth, width)
    causal = flops.training_flops_per_sample(tokens, params, depth, width, causal=True)
    assert full == tokens * (6 * params + 12 * depth * width * tokens)
    assert full - causal == tokens * 6 * depth * width * tokens


def test_the_built_lm_counts_causal_attention(tmp_path):
    """build's FLOP model reads causality from the model's attention cores: the GPT counts half, the ViT full."""
    from utils.cli.config import load_config
    from utils.engine.build import flops_per_sample
    from utils.tasks import build_task

    for model, causal in (("gpt_tiny", True), ("vit_tiny", False)):
        cfg, _, _ = load_config([f"model={model}", f"data={'wikitext_sample' if causal else 'era5_synthetic'}",
                                 f"data.root={tmp_path / model}"])
        task = build_task(cfg, load_data=False)
        with torch.device("meta"):
            net = task.build_model()
        want = flops.training_flops_per_sample(task.tokens_per_sample(), net.matmul_params(), cfg.model.depth,
                                               cfg.model.embed_dim, causal)
        assert flops_per_sample(cfg, task, net) == want, model


@pytest.mark.parametrize("ratio, where, status", [(0.82, "inside a node", "pass"), (0.78, "inside a node", "warn"),
                                                  (0.92, "across nodes", "pass"), (0.85, "across nodes", "warn"),
                                                  (0.2, "inside a node", "fail")])
def test_bandwidth_passes_at_the_achievable_fraction(ratio, where, status):
    assert bandwidth.bandwidth_status(ratio, bandwidth.ACHIEVABLE_FRACTION[where], 0.25) == status


def test_a_healthy_h100_node_passes(one_gpu):
    """370 GB/s of NVLink's nominal 450 inside a node and 46 of 50 across nodes: what healthy H100 nodes reach."""
    def group(gbs, spans):
        figures = {op: {"busbw_gbs": gbs, "ok": True} for op in bandwidth.OPS}
        return {"size": 8, "spans_nodes": spans, "sizes": {2**28: figures}}

    checks = bandwidth.bandwidth_checks({"tp": group(370.0, False), "dp": group(46.0, True)},
                                        torch.device("cuda", 0), 0.25)
    assert [c.status for c in checks] == ["pass"] * 4, [c.detail for c in checks]
    checks = bandwidth.bandwidth_checks({"tp": group(300.0, False)}, torch.device("cuda", 0), 0.25)
    assert checks[-1].status == "warn"


def test_synchronize_and_free_memory_call_the_device_only_on_cuda(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(("sync", str(device))))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(("empty_cache",)))
    monkeypatch.setattr(device_mod.gc, "collect", lambda: calls.append(("gc",)) or 0)
    device_mod.synchronize(torch.device("cpu"))
    device_mod.free_memory(torch.device("cpu"))
    assert calls == [("gc",)]
    device_mod.synchronize(torch.device("cuda", 1))
    device_mod.free_memory(torch.device("cuda", 1))
    assert calls[1:] == [("sync", "cuda:1"), ("gc",), ("empty_cache",)]


def test_collective_bench_times_to_the_end_of_the_device_work(monkeypatch):
    """Each timed call sits between two synchronizes (NCCL returns once a collective is queued)."""
    events = []
    monkeypatch.setattr(bench_collectives, "synchronize", lambda device: events.append("sync"))
    axis = AxisGroup("tp", 1, 0)
    ops = {"a": lambda: events.append("a"), "b": lambda: events.append("b")}
    sent, times = bench_collectives.time_interleaved(ops, 2, axis, torch.device("cuda", 0))
    timed = events[2:]  # after the warm-up calls
    assert timed == ["sync", "a", "sync", "sync", "b", "sync"] * 2
    assert set(sent) == {"a", "b"} and all(len(t) == 2 for t in times.values())


def test_doctor_comparison_frees_memory_and_holds_no_rank(monkeypatch, tmp_path):
    """Rank 1 of 2 runs its own single-device curve after the layout's trainer is gone and memory was
    freed, without any collective (an NCCL barrier would give up after parallel.init_timeout_s)."""
    class Trainer:
        pass

    seen, refs = [], []

    def build(cfg, grid, tmp):
        trainer = Trainer()
        refs.append(weakref.ref(trainer))
        return trainer

    def serial(cfg, device, steps, tmp):
        seen.append(("serial", refs[0]() is None))
        return {"loss": [1.0] * steps, "grad_norm": [2.0] * steps}

    def no_collective(*args, **kwargs):
        raise AssertionError("a collective in the comparison")

    monkeypatch.setattr(training, "build", build)
    monkeypatch.setattr(training, "curve", lambda trainer, steps: {"loss": [1.0] * steps, "grad_norm": [2.0] * steps})
    monkeypatch.setattr(training, "throughput_check", lambda trainer, warmup, steps: "perf")
    monkeypatch.setattr(training, "free_memory", lambda device: seen.append(("free", str(device))))
    monkeypatch.setattr(training, "serial_curve", serial)
    for name in ("barrier", "broadcast_object", "all_reduce"):
        monkeypatch.setattr(training, name, no_collective, raising=False)
    grid = SimpleNamespace(world_size=2, is_main=False, global_rank=1, device=torch.device("cpu"), name="tp2")
    cfg = SimpleNamespace(precision=SimpleNamespace(mode="fp32"))
    check, perf = training.training_checks(cfg, grid, 3, 2)
    assert seen == [("free", "cpu"), ("serial", True)]
    assert check.status == "pass" and perf == "perf"


def test_fewer_gpus_than_ranks_is_refused_unless_the_cpu_is_asked_for():
    assert local_launch.gpus_for_ranks("auto", 2, 2) is True
    assert local_launch.gpus_for_ranks("auto", 4, 0) is False  # no GPU at all: the CPU is all there is
    assert local_launch.gpus_for_ranks("cpu", 4, 2) is False
    with pytest.raises(ConfigError) as err:
        local_launch.gpus_for_ranks("auto", 4, 2)
    assert err.value.setting == "trainer.device" and "trainer.device=cpu" in err.value.fix


def test_train_mp_refuses_before_any_work(monkeypatch, capsys):
    """`python train_mp.py parallel=tp2` on a machine with one GPU: one line naming trainer.device, exit 2,
    nothing started."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(local_launch, "launch", lambda *a: pytest.fail("ranks started"))
    with pytest.raises(SystemExit) as stop:
        local_launch.launch_main(["parallel=tp2"])
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and len(err.splitlines()) == 1 and "(trainer.device)" in err, err
    started = []
    monkeypatch.setattr(local_launch, "launch", lambda argv, world, use_gpus: started.append((world, use_gpus)) or 0)
    assert local_launch.launch_main(["parallel=tp2", "trainer.device=cpu"]) == 0 and started == [(2, False)]


def test_the_kernel_comparison_fails_on_nan_and_inf():
    """The `-m gpu` kernel test's comparison (tests/test_gpu_blocks.py `_close`), on the CPU: a kernel output with
    a NaN or an inf where the float64 reference is finite fails, however close the rest; entries the reference
    itself has infinite (the log-sum-exp of rows that see no key) are left out, not compared as zero."""
    from tests.test_gpu_blocks import _close

    want = torch.tensor([[1.0, -2.0], [0.5, float("-inf")]], dtype=torch.float64)
    good = want.float().clone()
    _close(good, want, torch.float32, "exact")
    for bad in (float("nan"), float("inf")):
        got = good.clone()
        got[0, 1] = bad
        with pytest.raises(AssertionError, match="1 NaN or inf values where the reference is finite"):
            _close(got, want, torch.float32, "planted")
    got = good.clone()
    got[0, 0] = 1.5
    with pytest.raises(AssertionError, match="relative error 0.25"):
        _close(got, want, torch.float32, "off")

"""torchtitan (0.3.0) with ACCO across replicas, launched as its users launch it: ``torchrun -m torchtitan.train``'s
entry point on 4 CPU gloo ranks (``tests/torchtitan_cpu.py`` holds the CPU work-arounds, nothing else), the
``llama3_debugmodel`` config (and DeepSeek-V3's MoE debug model), ``--module acco.integrations.torchtitan`` against
torchtitan's own HSDP.

Every run starts from one seed checkpoint (torchtitan's ``--checkpoint.create_seed_checkpoint``, loaded model
only at step 0), as torchtitan compares parallelisms: DTensor's random initialization on CPU depends on the mesh.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from _dist import run_command
from extras import need

need("torchtitan", "torchtitan")

pytestmark = pytest.mark.slow  # make test-all only: real torchtitan launches

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "tests" / "torchtitan_cpu.py"
STEPS = 6
SMALL = ["--training.seq_len", "256", "--training.local_batch_size", "2", "--training.mixed_precision_param",
         "float32", "--validator.no-enable", "--parallelism.spmd_backend", "partial_dtensor"]
ACCO = ["--module", "acco.integrations.torchtitan", "--config", "llama3_debugmodel"]
HSDP = ["--module", "llama3", "--config", "llama3_debugmodel_ce_loss"]  # the same loss ACCO's config takes
MESHES = {"fsdp2": ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree",
                    "2"],
          "tp": ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree",
                 "1", "--parallelism.tensor_parallel_degree", "2"]}


def _global_batch(mesh: str) -> list:
    """Two micro-batches per update on every rank (mode acco's halves): local batch 2 x data-parallel degree x 2."""
    degree = 4 if mesh == "fsdp2" else 2
    return ["--training.global_batch_size", str(2 * degree * 2)]


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    """The tokenizer and the dataset, and the seed checkpoint every run starts from."""
    root = tmp_path_factory.mktemp("torchtitan")
    subprocess.run([sys.executable, str(LAUNCH), "--assets", str(root / "assets"), "--make-assets"], check=True,
                   timeout=300)
    run_command(_cmd(1, root, "seed", HSDP + SMALL + ["--debug.seed", "0", "--checkpoint.enable",
                                                      "--checkpoint.create_seed_checkpoint", "--training.steps", "1"]),
                timeout=300)
    assert (root / "seed" / "checkpoint" / "step-0").is_dir()
    return root


def _cmd(ranks: int, root: Path, name: str, args: list, only_rank0: bool = False) -> list:
    """``only_rank0``: only rank 0's output (with regions, each region logs its own gradient's norm)."""
    shown = ["--local-ranks-filter=0"] if only_rank0 else []
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", *shown,
            str(LAUNCH),
            "--assets", str(root / "assets"), "--", *args, "--dump_folder", str(root / name),
            "activation-checkpoint:none"]


def _train(root: Path, name: str, args: list, steps: int = STEPS, seeded: bool = True,
           seed: str = "seed/checkpoint/step-0") -> dict:
    """A 4-rank run from the seed checkpoint (copied in as its step 0); {step: (loss, grad_norm)} as the ranks log
    them (with ``--acco.regions``: as rank 0 logs them)."""
    if seeded:
        (root / name / "checkpoint").mkdir(parents=True, exist_ok=True)
        shutil.copytree(root / seed, root / name / "checkpoint" / "step-0", dirs_exist_ok=True)
    out = run_command(_cmd(4, root, name, args + SMALL + ["--training.steps", str(steps), "--checkpoint.enable",
                                                          "--checkpoint.interval", "3", "--checkpoint.keep_latest_k",
                                                          "0"], only_rank0="--acco.regions" in args), timeout=600)
    return _log(out)


def _log(out: str) -> dict:
    plain = re.sub(r"\x1b\[[0-9;]*m", "", out)
    rows = re.findall(r"step:\s+(\d+)\s+loss:\s+(\S+)\s+grad_norm:\s+(\S+)", plain)
    return {int(s): (float(loss), float(norm)) for s, loss, norm in rows}


@pytest.fixture(scope="module")
def fsdp2_runs(assets) -> dict:
    """torchtitan's HSDP, mode sync and mode acco on 2 replicas x FSDP2 2 from the seed, 6 steps (checkpoints at
    steps 3 and 6)."""
    mesh = MESHES["fsdp2"] + _global_batch("fsdp2")
    return {"hsdp": _train(assets, "hsdp", HSDP + mesh),
            "sync": _train(assets, "sync", ACCO + mesh + ["--acco.mode", "sync"]),
            "acco": _train(assets, "acco", ACCO + mesh)}


def test_sync_mode_is_torchtitans_hsdp_and_acco_trains_alike(fsdp2_runs):
    """2 replicas x FSDP2 2: ``--acco.mode sync`` (ZeRO-1 across replicas, no overlap) logs HSDP's loss and
    gradient norm at every step (the same sums in another order); mode acco (the default) ends within 1% of
    HSDP's loss after 6 steps, and its loss falls; every rank exits 0 (run_command)."""
    hsdp, sync, acco = fsdp2_runs["hsdp"], fsdp2_runs["sync"], fsdp2_runs["acco"]
    print(f"fsdp2: hsdp {hsdp}\nsync {sync}\nacco {acco}")  # shown with pytest -s
    assert sorted(hsdp) == sorted(sync) == sorted(acco) == list(range(1, STEPS + 1)), (hsdp, sync, acco)
    for step in hsdp:
        (lh, nh), (ls, ns) = hsdp[step], sync[step]
        assert abs(ls - lh) <= 2e-4 * lh and abs(ns - nh) <= 2e-3 * nh, (step, hsdp, sync)
    assert acco[1][0] == pytest.approx(hsdp[1][0], rel=1e-4)  # the seed's weights, before any update
    assert abs(acco[STEPS][0] - hsdp[STEPS][0]) <= 0.01 * hsdp[STEPS][0], (hsdp, acco)
    assert acco[STEPS][0] < acco[1][0] - 0.1, acco
    assert all(n > 0 for _, n in acco.values()), acco  # the logged norm is ACCO's, not clip_grad_norm_'s of no .grad


def test_tensor_parallel_inside_replicas(assets):
    """2 replicas x TP 2 (torchtitan's Llama plan, SequenceParallel norms): mode sync equals HSDP's losses, mode
    acco ends within 1% of them."""
    hsdp = _train(assets, "hsdp-tp", HSDP + MESHES["tp"] + _global_batch("tp"))
    sync = _train(assets, "sync-tp", ACCO + MESHES["tp"] + _global_batch("tp") + ["--acco.mode", "sync"])
    acco = _train(assets, "acco-tp", ACCO + MESHES["tp"] + _global_batch("tp"))
    print(f"tp: hsdp {hsdp}\nsync {sync}\nacco {acco}")  # shown with pytest -s
    for step in hsdp:
        assert abs(sync[step][0] - hsdp[step][0]) <= 2e-4 * hsdp[step][0], (step, hsdp, sync)
    assert abs(acco[STEPS][0] - hsdp[STEPS][0]) <= 0.01 * hsdp[STEPS][0], (hsdp, acco)


def _resumes_bit_identically(assets, straight_name: str, straight: dict, args: list) -> dict:
    """``args`` resumed from ``straight_name``'s step-3 checkpoint logs ``straight``'s losses and gradient norms
    at steps 4-6 to the last digit, and its step-6 checkpoint holds the same tensors. Returns the step-6
    checkpoint's tensors by key."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    resumed_name = f"{straight_name}-resumed"
    shutil.copytree(assets / straight_name / "checkpoint" / "step-3", assets / resumed_name / "checkpoint" / "step-3")
    resumed = _train(assets, resumed_name, args, seeded=False)
    assert sorted(resumed) == [4, 5, 6], resumed
    assert {s: straight[s] for s in resumed} == resumed, (straight, resumed)
    flat = []
    for n in (straight_name, resumed_name):
        dcp_to_torch_save(str(assets / n / "checkpoint" / "step-6"), str(assets / n / "step6.pt"))
        flat.append(_tensors(torch.load(assets / n / "step6.pt", weights_only=False)))
    assert flat[0].keys() == flat[1].keys() and len(flat[0]) > 10
    differ = [k for k in flat[0] if not torch.equal(flat[0][k], flat[1][k])]
    assert differ == [], differ[:5]
    return flat[1]


def test_a_stopped_run_resumes_bit_identically(assets, fsdp2_runs):
    """torchtitan's checkpointer (DCP): a run resumed from its step-3 checkpoint logs the straight run's losses
    and gradient norms to the last digit, and its step-6 checkpoint holds the same tensors."""
    _resumes_bit_identically(assets, "acco", fsdp2_runs["acco"], ACCO + MESHES["fsdp2"] + _global_batch("fsdp2"))


def test_compressed_rounds_across_replicas_train_alike_and_resume_bit_identically(assets, fsdp2_runs):
    """``--acco.compression int8`` on 2 replicas x FSDP2 2 (the rounds across replicas in 8 bits, FSDP2's own
    traffic as it is): within 1% of HSDP's loss after 6 steps, not the uncompressed run's (the quantizer is in
    the path), and a run resumed from step 3 is bit-identical, each rank's error-feedback residual in the
    checkpoint."""
    args = ACCO + MESHES["fsdp2"] + _global_batch("fsdp2") + ["--acco.compression", "int8"]
    int8 = _train(assets, "int8", args)
    hsdp, acco = fsdp2_runs["hsdp"], fsdp2_runs["acco"]
    print(f"int8: {int8}\nhsdp {hsdp}")  # shown with pytest -s
    assert sorted(int8) == list(range(1, STEPS + 1)), int8
    assert abs(int8[STEPS][0] - hsdp[STEPS][0]) <= 0.01 * hsdp[STEPS][0] and int8[STEPS][0] < int8[1][0] - 0.1, int8
    assert int8[STEPS] != acco[STEPS], (int8, acco)
    saved = _resumes_bit_identically(assets, "int8", int8, args)
    residuals = [k for k in saved if ".residual." in k]
    assert len(residuals) == 4 and all(saved[k].abs().sum() > 0 for k in residuals), sorted(saved)[:40]


def test_regions_train_and_resume_bit_identically(assets, fsdp2_runs):
    """``--acco.regions 2 --acco.outer_every 3``: 2 regions of one replica x FSDP2 2, an outer step (DiLoCo's)
    at steps 3 and 6, where the checkpoints are. The loss falls and ends within 3% of HSDP's; the first update's
    logged gradient norm (region 0's) is its region's mean gradient's, not half of it (the region's sum is scaled
    by the regions); a run resumed from step 3 is bit-identical, each region's outer state
    (anchor and momentum, per model shard) in the checkpoint."""
    args = ACCO + MESHES["fsdp2"] + _global_batch("fsdp2") + ["--acco.regions", "2", "--acco.outer_every", "3"]
    regions = _train(assets, "regions", args)
    hsdp, acco = fsdp2_runs["hsdp"], fsdp2_runs["acco"]
    print(f"regions: {regions}\nhsdp {hsdp}")  # shown with pytest -s
    assert sorted(regions) == list(range(1, STEPS + 1)), regions
    assert regions[1][0] == pytest.approx(hsdp[1][0], rel=1e-4)  # the seed's weights
    # both log mode acco's first estimate round's norm: region 0's on a quarter of the batch, ACCO's on half, a
    # larger norm (more noise; 1.31x when measured); unscaled, the region's sum would be half of that (0.65x)
    assert regions[1][1] > 0.9 * acco[1][1], (regions[1], acco[1])
    assert abs(regions[STEPS][0] - hsdp[STEPS][0]) <= 0.03 * hsdp[STEPS][0], (hsdp, regions)
    assert regions[STEPS][0] < regions[1][0] - 0.1 and regions[STEPS] != acco[STEPS], (regions, acco)
    saved = _resumes_bit_identically(assets, "regions", regions, args)
    anchors = sorted(k for k in saved if ".anchor" in k)
    assert len(anchors) == 4 and any("region1-shard1" in k for k in anchors), anchors


MOE_ACCO = ["--module", "acco.integrations.torchtitan", "--config", "deepseek_v3_debugmodel"]
MOE_HSDP = ["--module", "torchtitan_configs", "--config", "deepseek_v3_debugmodel_ce_loss"]  # the tests' own
DEAD = 2  # routed experts 0 and 1 of every MoE layer: the router never picks them


@pytest.fixture(scope="module")
def moe_seed(assets) -> str:
    """A seed checkpoint of DeepSeek-V3's debug model (8 routed experts, top 3, 2 shared, in 5 of its 6 layers)
    whose load-balancing biases keep the router from experts 0 and 1 (-1e4: an expert that collapsed). Their
    weights then get zero gradients, a slice of each 3-D expert parameter that AdamW still moves (its weight
    decay), as torch does with any zero gradient. The path under ``assets``."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

    run_command(_cmd(1, assets, "moe-seed", MOE_HSDP + SMALL + ["--debug.seed", "0",
        "--checkpoint.enable", "--checkpoint.create_seed_checkpoint", "--training.steps", "1"]), timeout=300)
    dcp_to_torch_save(str(assets / "moe-seed" / "checkpoint" / "step-0"), str(assets / "moe-seed.pt"))
    state = torch.load(assets / "moe-seed.pt", weights_only=False)
    biases = [k for k in state if k.endswith("moe.expert_bias_E")]
    assert len(biases) == 5, sorted(state)
    for k in biases:
        state[k][:DEAD] = -1e4
    torch.save(state, assets / "moe-seed-dead.pt")
    torch_save_to_dcp(str(assets / "moe-seed-dead.pt"), str(assets / "moe-seed-dead"))
    return "moe-seed-dead"


MOE_STEPS = 4


@pytest.fixture(scope="module")
def moe_runs(assets, moe_seed) -> dict:
    """HSDP, mode sync and mode acco on 2 replicas x FSDP2 2 from ``moe_seed``, 4 steps (each saves its last)."""
    mesh = MESHES["fsdp2"] + _global_batch("fsdp2")
    return {"hsdp": _train(assets, "moe-hsdp", MOE_HSDP + mesh, MOE_STEPS, seed=moe_seed),
            "sync": _train(assets, "moe-sync", MOE_ACCO + mesh + ["--acco.mode", "sync"], MOE_STEPS, seed=moe_seed),
            "acco": _train(assets, "moe-acco", MOE_ACCO + mesh, MOE_STEPS, seed=moe_seed)}


def test_moe_experts_the_router_never_picks_move_as_torch_moves_them(assets, moe_runs):
    """2 replicas x FSDP2 2, DeepSeek-V3's MoE debug model with two dead experts per layer (``moe_seed``), 4 steps:
    mode sync logs HSDP's loss and norm at every step, mode acco ends within 1% of HSDP's loss. The dead experts'
    weights moved from the seed (AdamW's decay on a zero gradient) and equal HSDP's in both modes; torchtitan's
    load-balancing hook (a pre-step hook on the optimizers container) ran on ACCO's step(): the biases equal
    HSDP's in mode sync."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    steps, logs = MOE_STEPS, moe_runs
    print(f"moe: {logs}")  # shown with pytest -s
    hsdp, sync, acco = logs["hsdp"], logs["sync"], logs["acco"]
    assert sorted(hsdp) == sorted(sync) == sorted(acco) == list(range(1, steps + 1)), logs
    for step in hsdp:
        (lh, nh), (ls, ns) = hsdp[step], sync[step]
        assert abs(ls - lh) <= 2e-4 * lh and abs(ns - nh) <= 2e-3 * nh, (step, logs)
    assert abs(acco[steps][0] - hsdp[steps][0]) <= 0.01 * hsdp[steps][0] and acco[steps][0] < acco[1][0] - 0.3, logs
    seed = torch.load(assets / "moe-seed-dead.pt", weights_only=False)
    final = {}
    for name in logs:
        dcp_to_torch_save(str(assets / f"moe-{name}" / "checkpoint" / f"step-{steps}"), str(assets / f"moe-{name}.pt"))
        final[name] = torch.load(assets / f"moe-{name}.pt", weights_only=False)
    experts = [k for k in seed if ".inner_experts.w" in k]
    assert len(experts) == 15, experts
    for k in experts:
        moved = (final["hsdp"][k][:DEAD] - seed[k][:DEAD]).norm()
        assert moved > 0, k
        for name in ("sync", "acco"):
            assert (final[name][k][:DEAD] - final["hsdp"][k][:DEAD]).norm() <= 1e-4 * moved, (name, k)
    for k in (k for k in seed if k.endswith("expert_bias_E")):
        assert torch.equal(final["sync"][k], final["hsdp"][k]) and not torch.equal(final["sync"][k], seed[k]), k


def test_a_checkpoint_of_two_replicas_resumes_on_one(assets, moe_runs):
    """Resharding: the step-4 checkpoints of 2 replicas x FSDP2 2 resumed on 1 replica x FSDP2 2 (2 ranks, ACCO
    on each rank alone). Mode sync logs what torchtitan's own HSDP logs from its checkpoint at steps 5 and 6, so
    ACCO's state (AdamW's moments, from 2 owners' chunks onto 1) was loaded: HSDP without its optimizer state
    logs another step-6 loss. torchtitan's dataloader refuses a change of data-parallel degree
    (``--checkpoint.exclude_from_loading dataloader``)."""
    def resume(name: str, source: str, args: list, exclude: str = "dataloader") -> dict:
        (assets / name / "checkpoint").mkdir(parents=True, exist_ok=True)
        shutil.copytree(assets / source / "checkpoint" / f"step-{MOE_STEPS}",
                        assets / name / "checkpoint" / f"step-{MOE_STEPS}", dirs_exist_ok=True)
        return _log(run_command(_cmd(2, assets, name, args + SMALL + [
            "--parallelism.data_parallel_replicate_degree", "1", "--parallelism.data_parallel_shard_degree", "2",
            "--training.global_batch_size", "8", "--training.steps", "6", "--checkpoint.enable",
            "--checkpoint.interval", "10", "--checkpoint.exclude_from_loading", exclude]), timeout=600))

    hsdp = resume("rs-hsdp", "moe-hsdp", MOE_HSDP)
    sync = resume("rs-sync", "moe-sync", MOE_ACCO + ["--acco.mode", "sync"])
    fresh = resume("rs-fresh", "moe-hsdp", MOE_HSDP, exclude="dataloader,optimizer")
    print(f"resharded: hsdp {hsdp} sync {sync} without optimizer state {fresh}")  # shown with pytest -s
    assert sorted(hsdp) == sorted(sync) == [5, 6], (hsdp, sync)
    for step in hsdp:
        assert abs(sync[step][0] - hsdp[step][0]) <= 2e-4 * hsdp[step][0], (step, hsdp, sync)
    assert abs(fresh[6][0] - hsdp[6][0]) > 20 * abs(sync[6][0] - hsdp[6][0]) + 1e-3, (hsdp, sync, fresh)


def _tensors(tree, prefix: str = "") -> dict:
    import torch

    out = {}
    if isinstance(tree, dict):
        for k, v in tree.items():
            out.update(_tensors(v, f"{prefix}{k}."))
    elif isinstance(tree, torch.Tensor):
        out[prefix] = tree
    return out


@pytest.mark.parametrize("args,words", [
    (["--parallelism.pipeline_parallel_degree", "2"], "pipeline parallelism"),
    (["--parallelism.spmd_backend", "full_dtensor"], "use --parallelism.spmd_backend partial_dtensor"),
    (["--training.global_batch_size", "2"], "mode acco needs 2 or more micro-batches per update, got 1"),
    (["--acco.regions", "2"], "give both (regions 2 or more, outer_every >= 1)"),
    (["--acco.regions", "2", "--acco.outer_every", "3"], "give a degree that the regions divide"),
    (["--acco.regions", "2", "--acco.outer_every", "4", "--checkpoint.enable", "--checkpoint.interval", "3",
      "--parallelism.data_parallel_replicate_degree", "2"],
     "set --acco.outer_delay 0 and --checkpoint.interval and --training.steps to multiples of --acco.outer_every"),
])
def test_refused_at_start_with_the_reason(assets, args, words):
    """What ACCO cannot run under torchtitan stops the job at start, naming it and the fix."""
    cmd = _cmd(1, assets, "refused", ACCO + SMALL + args)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and words in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-3000:]


def test_compression_with_tensor_parallelism_inside_is_refused_at_start(assets):
    """``--acco.compression int8`` on 2 replicas x TP 2: the parameters TP replicates would be rounded
    differently on each rank of a replica, so every rank stops at start, naming them and the fix."""
    cmd = _cmd(4, assets, "refused-tp-int8", ACCO + SMALL + MESHES["tp"] + _global_batch("tp") + [
        "--acco.compression", "int8", "--training.steps", "1"])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "with tensor parallelism, drop compression" in out, out[-3000:]

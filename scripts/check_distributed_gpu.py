"""Check the data-parallel learner's GPU path on a machine with CUDA GPUs (not run in CI: no GPU there).

    torchrun --standalone --nproc-per-node 2 scripts/check_distributed_gpu.py      # one GPU per rank
    torchrun --standalone --nproc-per-node 1 scripts/check_distributed_gpu.py      # one GPU: FSDP2 over 1 rank
    torchrun --standalone --nproc-per-node 2 scripts/check_distributed_gpu.py --device cpu   # the same on gloo

What it checks, and prints as it goes:
  1. the group: NCCL on cuda:<LOCAL_RANK> (``distributed.group.init_from_env``), a 1-D CUDA device mesh
  2. the sharded learner: FSDP2 per decoder layer + scoring root on the GPU, each rank holding ≈ 1/N of the
     parameters (``ShardedLearner``; ranks > 0 built as skeletons, their shards broadcast from rank 0); with ``--bf16``, FSDP2's ``MixedPrecisionPolicy`` (bf16 compute,
     fp32 gradient reduction) — the option that differs from the CPU path
  3. three ``train_step``s (recompute, decoupled token TIS, GRPO, 2 mini-batches) on rollouts sampled once on
     rank 0 and broadcast, against one un-sharded fp32 learner on rank 0's GPU trained on the same batches:
     relative weight difference ≤ 1e-4 in fp32 (GPU kernels reorder sums), ≤ 5e-2 with ``--bf16``
  4. the full-weight gather for publishing (``ShardedLearner.state_dict``) and its seconds
  5. a DCP checkpoint written by every rank and read back into a fresh sharded learner
Exit status 0 when every check passed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def say(ranks, text: str) -> None:
    if ranks.is_main:
        print(f"[check] {text}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--bf16", action="store_true", help="FSDP2 mixed precision: bf16 params, fp32 reduce")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("[check] no CUDA device: this script checks the GPU path (use --device cpu for the gloo path)")
        return 2

    from rollcorr.distributed import close, init_from_env
    from rollcorr.distributed.shard import peak_parameter_bytes
    from rollcorr.engines import make_learner
    from rollcorr.train.build import build_proximal, build_step_config
    from rollcorr.train.config import load_config
    from rollcorr.train.source import SourceSpec, sample_batch
    from rollcorr.train.step import train_step

    ranks = init_from_env(args.device)
    ok = True
    try:
        say(ranks, f"1. group: backend {ranks.backend}, {ranks.world} ranks, rank 0 on {ranks.device}, "
                   f"mesh {ranks.mesh.device_type}")
        assert ranks.backend == ("nccl" if args.device == "cuda" else "gloo")
        config = load_config(None, ["task.eval_prompts=0", "algorithm.correction.preset=decoupled_token_is"])
        rollouts = None
        if ranks.is_main:
            source = SourceSpec.from_config(config).build()
            rollouts = [sample_batch(source, i) for i in range(args.steps)]
        rollouts = ranks.broadcast(rollouts)

        # trainer.fsdp.param_dtype=bf16 trainer.fsdp.reduce_dtype=fp32 with --bf16 (the trainer's own mapping)
        options = {"param_dtype": "bf16", "reduce_dtype": "fp32"} if args.bf16 else {}
        torch.manual_seed(0)
        learner = make_learner("hf:fp32", device="cpu", skeleton=not ranks.is_main)  # as the trainer builds it
        learner.model.train(False)
        whole = sum(t.numel() * t.element_size() for t in learner.model.state_dict().values())
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        sharded = ranks.shard(learner, **options)
        if args.device == "cuda":
            built = torch.cuda.max_memory_allocated()
            say(ranks, f"2a. building: rank 0's GPU peaked at {built / 2**20:.2f} MiB while sharding "
                       f"(the whole model: {whole / 2**20:.2f} MiB in host memory; at N > 1 the peak is its shards "
                       f"and one unit, not the whole)")
        step_config, proximal = build_step_config(config), build_proximal(config)
        optimizer = torch.optim.AdamW([p for p in sharded.model.parameters() if p.requires_grad], lr=3e-4)
        start = time.perf_counter()
        for step in range(args.steps):
            train_step(rollouts[step], sharded, optimizer, proximal, step_config, step, ranks=ranks)
        seconds = time.perf_counter() - start
        held = peak_parameter_bytes(sharded.model, optimizer)
        say(ranks, f"2. sharded learner: rank 0 holds {held['parameters'] / 2**20:.2f} MiB of parameters and "
                   f"{held['optimizer_state'] / 2**20:.2f} MiB of AdamW state; {args.steps} steps in {seconds:.1f} s")

        start = time.perf_counter()
        full = sharded.state_dict()
        say(ranks, f"4. full-weight gather for publishing: {time.perf_counter() - start:.3f} s")

        if ranks.is_main:  # the reference: one un-sharded learner on rank 0's device
            torch.manual_seed(0)
            single = make_learner("hf:fp32", device=str(ranks.device))
            single.model.train(False)
            single.share_prompts = False
            ref_opt = torch.optim.AdamW([p for p in single.model.parameters() if p.requires_grad], lr=3e-4)
            ref_proximal = build_proximal(config)
            for step in range(args.steps):
                train_step(rollouts[step], single, ref_opt, ref_proximal, step_config, step)
            ref = single.model.state_dict()
            num = sum(float((full[k].float() - ref[k].float().cpu()).norm() ** 2) for k in ref)
            den = sum(float(ref[k].float().norm() ** 2) for k in ref)
            rel = (num / den) ** 0.5
            bound = 5e-2 if args.bf16 else 1e-4
            ok = rel <= bound
            say(ranks, f"3. {ranks.world} ranks vs one process after {args.steps} steps: relative weight "
                       f"difference {rel:.2e} (bound {bound:g}) {'OK' if ok else 'FAILED'}")
        ok = ranks.all_true(ok)

        from rollcorr.checkpoint import DCP_DIR, load_sharded

        folder = ranks.broadcast(tempfile.mkdtemp() if ranks.is_main else None)
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(sharded.model, optimizer)
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(Path(folder) / DCP_DIR))
        fresh = ranks.shard(make_learner("hf:fp32", device=str(ranks.device)), **options)
        fresh_opt = torch.optim.AdamW([p for p in fresh.model.parameters() if p.requires_grad], lr=3e-4)
        load_sharded(Path(folder), fresh.model, fresh_opt)
        again = fresh.state_dict()
        if ranks.is_main:
            same = all(torch.equal(again[k], full[k]) for k in full)
            say(ranks, f"5. DCP checkpoint written by {ranks.world} ranks and read back into a fresh sharded "
                       f"learner: weights equal: {same} (N → 1 resharding: tests/test_distributed_train.py)")
            ok = ok and same
        ok = ranks.all_true(ok)
        say(ranks, "all checks passed" if ok else "a check FAILED")
    finally:
        close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

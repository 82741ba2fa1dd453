"""Run under torchrun (gloo, 4 ranks, TP=2 x DP=2): the tokens' host copy reaches every TP rank
over the gloo copy of the tensor-parallel group (``training/batch.py``), equal to what TP rank 0
read; without that group, TP rank 1 has none. Exits non-zero with a message on a mismatch."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist


def main() -> None:
    from megatron_ext.compat import cpu

    cpu.install()
    dist.init_process_group("gloo")
    from megatron.core import parallel_state as mpu

    from megatron_ext.training import batch as batches

    mpu.initialize_model_parallel(tensor_model_parallel_size=2)
    rank, tp_rank = dist.get_rank(), mpu.get_tensor_model_parallel_rank()
    args = SimpleNamespace(micro_batch_size=2, seq_length=8,
                           create_attention_mask_in_dataloader=False)

    def data(step):  # what each TP rank 0 reads: its DP rank's batch
        tokens = torch.arange(16).view(2, 8) + 100 * step + 1000 * mpu.get_data_parallel_rank()
        return iter([{"tokens": tokens, "labels": tokens, "loss_mask": torch.ones(2, 8),
                      "position_ids": torch.arange(8).repeat(2, 1)}]) if tp_rank == 0 else None

    got = batches.get_batch(data(0), args, host_tokens=True)
    if tp_rank == 1 and got[5] is not None:
        sys.exit("TP rank 1 had host tokens without the gloo TP group")
    host_group = batches.HostTokenGroup()  # a training session's
    host_group.make()
    group = host_group.group
    if dist.get_backend(group) != "gloo" or sorted(dist.get_process_group_ranks(group)) != \
            sorted(dist.get_process_group_ranks(mpu.get_tensor_model_parallel_group())):
        sys.exit(f"rank {rank}: the host TP group is not a gloo copy of the TP group")
    for step in (1, 2):
        got = batches.get_batch(data(step), args, host_tokens=True, host_group=host_group)
        host = got[5]
        if host is None or host.device.type != "cpu" or not torch.equal(host, got[0].cpu()):
            sys.exit(f"rank {rank} (TP rank {tp_rank}) step {step}: host tokens {host} differ "
                     f"from the batch's {got[0]}")
    host_group.close()
    dist.barrier()
    if rank == 0:
        print("host tokens ok on every TP rank")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

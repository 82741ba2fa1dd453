"""Train a gpt / stem model: ``torchrun --nproc_per_node=N launch/pretrain.py <flags>``."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if __name__ == "__main__":  # the guard matters: torch_dist checkpoint saving starts processes
    from megatron_ext.training.entry import main

    main()

"""``launch/pretrain.py`` whose rank 1 corrupts its table rows' state before its third call of the
compiled sparse step: a row's last iteration set to one the optimizer's clock does not know, so
the kernel refuses the call (``RowKernelError``) on the tables' worker thread. Used by
``tests/test_row_kernel_refusal_training.py``: the run must end with that one line."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron_ext_kernels import row_adam_cpu  # noqa: E402

_step = row_adam_cpu._Kernels.sparse_adamw_
_calls = [0]


def corrupting_step(self, p, m, v, rows, g, last, touched, clock, *rest):
    _calls[0] += 1
    if os.environ.get("RANK") == "1" and _calls[0] == 3 and rows.numel():
        last[rows[0]] = clock[5] + 1000  # clock[5]: the iteration the rows are brought to
    return _step(self, p, m, v, rows, g, last, touched, clock, *rest)


if __name__ == "__main__":
    row_adam_cpu._Kernels.sparse_adamw_ = corrupting_step
    from megatron_ext.training.entry import main

    main()

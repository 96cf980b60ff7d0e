"""A rank that dies in the middle of training with backend="braid", run as every rank of a job:

    torchrun --nproc_per_node 3 python/tests/torch_fault.py TIMEOUT_S

Every rank trains a small model with DDP; rank 1 leaves the job abruptly (os._exit(0), so the launcher
does not stop the others) in its fourth step. Every survivor's next torch call must raise within twice
the process group's timeout, with an error that names rank 1; each prints
`rank R: raised after S s: MESSAGE`, and rank 1 prints `rank 1: leaving`.
"""

import datetime
import faulthandler
import os
import sys
import time
from pathlib import Path

faulthandler.enable()  # a crash prints every thread's stack
faulthandler.dump_traceback_later(int(os.environ.get("BRAID_TEST_WATCHDOG_S", "120")), exit=True)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import braid.torch  # noqa: E402,F401


def main():
    timeout = float(sys.argv[1])
    dist.init_process_group("braid", timeout=datetime.timedelta(seconds=timeout))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(64, 64))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(1000):
        if rank == 1 and step == 3:
            print("rank 1: leaving", flush=True)
            os._exit(0)
        start = time.monotonic()
        try:
            loss = model(torch.randn(8, 64)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        except Exception as e:  # what a training loop would see
            took = time.monotonic() - start
            print(f"rank {rank}: raised after {took:.1f} s: {type(e).__name__}: {e}", flush=True)
            if took > 2 * timeout:
                raise AssertionError(f"rank {rank}: the error took {took:.1f} s, more than twice {timeout} s")
            os._exit(0)  # the process group is unusable; leave without its shutdown
    raise AssertionError(f"rank {rank}: training went on without rank 1")


if __name__ == "__main__":
    main()

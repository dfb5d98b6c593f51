"Two CPU processes joined by gloo, for the 1-process vs 2-process tests."
import contextlib, gc, os, socket

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); return s.getsockname()[1]


@contextlib.contextmanager
def gloo_group(rank, world, port):
    "This process as `rank` of a gloo group on 127.0.0.1:`port`, one thread; the group is destroyed on exit, after"
    " the garbage the body left (a trainer's DDP wrapper holds the group's backend: freed only at interpreter exit, it"
    " can abort the process with `terminate called without an active exception`)."
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try: yield
    finally:
        gc.collect()
        torch.distributed.destroy_process_group()


def spawn_two(worker, *args):
    "Run worker(rank, 2, port, *args) in two processes and wait for both."
    mp.spawn(worker, args=(2, free_port(), *args), nprocs=2, join=True)

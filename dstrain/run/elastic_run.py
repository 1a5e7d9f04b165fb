"""torchrun with a shorter exit barrier: `python -m dstrain.run.elastic_run <torchrun arguments>` (launch/elastic.sh).

At the end of a job torch's elastic agent waits for every agent of the last rendezvous round, up to 300 s, and a
node lost after that round formed never comes: the job's survivors sat 5 minutes before exiting. The ranks of a
dstrain run already leave together (rank 0 waits for the others), so the agents need not wait long:
DSTRAIN_EXIT_BARRIER_TIMEOUT seconds, 30 by default. It also sets DSTRAIN_ELASTIC=1 for the ranks: a world the run
cannot use is fitted, not refused (dstrain/run/elastic.py). Everything else is torchrun's.
"""
from __future__ import annotations


def main() -> None:
    from torch.distributed.run import main as torchrun

    from dstrain import env
    from dstrain.parallel import ds_internals

    ds_internals.elastic_agent_exit_barrier(env.exit_barrier_timeout())
    env.export("DSTRAIN_ELASTIC", "1")  # the ranks inherit it
    torchrun()


if __name__ == "__main__":
    main()

"""`train.py --plan`: measure this cluster, predict every strategy's step time, write the best as a config.

    deepspeed --hostfile hosts train.py --recipe R --plan              # same launcher, same ranks as the run
    deepspeed --hostfile hosts train.py --recipe R --plan --trial 3    # then run the top 3 for a few steps each
    python train.py --recipe R --plan --simulate --device h100-80gb --interconnect ib-ndr   # on paper, 1-1,024 GPUs

probe.py measures (compute at the model's shapes, collectives per link level, memory), cost.py predicts
(memory fit from the preflight's model; step time = compute + exposed communication + optimizer/offload),
trial.py runs candidates as real train.py jobs on the same ranks, simulate.py extrapolates with tables of
GPUs and interconnects. DeepSpeed's autotuner tries ZeRO stages and micro-batch sizes by trial runs and knows
nothing of the network; this is the network-aware part, written here because no library does it.
Everything lands in <run dir>/plan/: plan.json (measurements, every prediction), best.json (a DeepSpeed
config train.py takes as it is) and best.txt (the command line with its recipe overrides).
"""
# The entry point is plan.run (train.py --plan); this package's __init__ stays empty of code so that importing one
# of its modules (metrics.py asks cost.remedy) does not pull in the others.

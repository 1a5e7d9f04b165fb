"""log.trace_steps: a torch.profiler trace of a few steps on every rank, for Perfetto and as an op table.

Steps A-B (1-based, A >= 2: step 1 holds one-off costs) are recorded from the end of step A-1 to the end of step
B: CPU ops and, on GPUs, every kernel. Each rank writes `trace/rank<R>.json` (Chrome trace format: open it at
ui.perfetto.dev) and `trace/rank<R>_ops.txt` (torch's table of ops by their own time: device time on GPUs, CPU time
otherwise). bench/profile_steps.py reads these next to a plain PyTorch loop's (kernel tables, host gaps).
The profiler runs only over those steps, so the other steps pay nothing.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from ..config import Recipe
from . import Component, Setup


class Trace(Component):
    name = "trace"

    def __init__(self, first: int, last: int):
        self.first, self.last = first, last
        self.profiler = None

    def describe(self) -> dict:
        return {"steps": [self.first, self.last]}

    def attach(self, engine, setup: Setup) -> None:
        self.out, self.rank, self.cuda = setup.run_dir / "trace", setup.ctx.rank, engine.device.type == "cuda"

    def after_step(self, step: int, say: Callable[[str], None]) -> None:
        if step == self.first - 1:
            activities = [torch.profiler.ProfilerActivity.CPU] + (
                [torch.profiler.ProfilerActivity.CUDA] if self.cuda else [])
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.__enter__()
        elif step == self.last and self.profiler is not None:
            if self.cuda:
                torch.cuda.synchronize()  # the last step's kernels are in the trace
            self.profiler.__exit__(None, None, None)
            self.out.mkdir(exist_ok=True)
            self.profiler.export_chrome_trace(str(self.out / f"rank{self.rank}.json"))
            sort = "self_cuda_time_total" if self.cuda else "self_cpu_time_total"
            (self.out / f"rank{self.rank}_ops.txt").write_text(
                self.profiler.key_averages().table(sort_by=sort, row_limit=60, max_name_column_width=70))
            self.profiler = None
            say(f"trace of steps {self.first}-{self.last}: {self.out}/rank{self.rank}.json (ui.perfetto.dev), "
                f"ops by time in rank{self.rank}_ops.txt")


def make(recipe: Recipe) -> Trace | None:
    steps = recipe.log.trace_range()
    return Trace(*steps) if steps else None

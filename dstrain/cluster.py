"""Check a cluster before anything starts on it, so a mistake costs seconds, not a queue wait.

    python -m dstrain.cluster --hostfile HOSTFILE [--ssh_port 22] [--no_ssh] [train.py arguments...]

1. the hostfile parses (DeepSpeed's format: `HOST slots=N` per line, `#` comments);
2. every host answers over ssh without a password (skipped with --no_ssh);
3. the world it implies (the sum of slots) agrees with the recipe: batch arithmetic, pipeline stages and
   tensor-parallel size divide it, and a recipe written for another `world_size` is flagged with the
   grad_accum_steps that keeps its global batch.
Every problem is printed on its own line; the exit status is 2 when there is any, 0 otherwise.
launch/multi_node.sh and launch/slurm.sbatch run it before the launcher.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from .cli import load_inputs
from .errors import EXIT_OK, EXIT_USER_ERROR, UserError
from .model import hidden_size, load_config
from .parallel import ds_config
from .parallel.layout import Layout, recipe_accumulation

HOST_LINE = re.compile(r"^(?P<host>[A-Za-z0-9_.:\[\]-]+)\s+slots=(?P<slots>\S+)$")


@dataclass(frozen=True)
class Host:
    name: str
    slots: int


def parse_hostfile(path: str | Path) -> list[Host]:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"hostfile {path} does not exist; write one line 'HOST slots=N' per node "
                        f"(see launch/hostfile.example)")
    hosts: list[Host] = []
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = HOST_LINE.match(line)
        if not match:
            raise UserError(f"{path}:{number}: '{line}' is not 'HOST slots=N' (for example 'node1 slots=8')")
        slots = match.group("slots")
        if not slots.isdigit() or int(slots) < 1:
            raise UserError(f"{path}:{number}: slots={slots} must be a positive integer (devices on that host)")
        if any(h.name == match.group("host") for h in hosts):
            raise UserError(f"{path}:{number}: host {match.group('host')} is listed twice; give it one line "
                            f"with all its slots")
        hosts.append(Host(match.group("host"), int(slots)))
    if not hosts:
        raise UserError(f"hostfile {path} lists no hosts; write one line 'HOST slots=N' per node")
    return hosts


def ssh_problems(hosts: list[Host], port: int | None, timeout: int = 10) -> list[str]:
    """One line per host that does not run a command over non-interactive ssh."""
    def probe(host: Host) -> str | None:
        cmd = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={timeout}", "-o",
               "StrictHostKeyChecking=accept-new"] + (["-p", str(port)] if port else []) + [host.name, "true"]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 5)
        except FileNotFoundError:
            return "ssh is not installed here; install openssh-client, or launch each node with NO_SSH=1"
        except subprocess.TimeoutExpired:
            return f"host {host.name}: ssh did not answer in {timeout + 5}s"
        if proc.returncode == 0:
            return None
        why = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        return (f"host {host.name}: ssh{' -p ' + str(port) if port else ''} failed ({why}); set up passwordless "
                f"ssh to it (ssh-copy-id), or launch each node with NO_SSH=1")

    with ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
        return [p for p in pool.map(probe, hosts) if p]


def world_report(world: int, train_argv: list[str]) -> str:
    """A line describing how the recipe splits this world; UserError when it cannot."""
    args, recipe, ds_overrides = load_inputs(train_argv)  # the same argument parsing as the run itself
    raw = ds_config.load(recipe.ds_config, ds_overrides)
    try:  # only the ZeRO-3 "auto" bucket sizes need the model; they do not change what fits the world
        hidden = hidden_size(load_config(recipe.model, recipe.train.seq_len)[1])
    except UserError as e:
        print(f"cluster check: warning: {e}", file=sys.stderr)
        hidden = 4096
    # the device type of the nodes is not known here; precision is checked by each rank at start
    caps = ds_config.DeviceCaps(name="cluster", bf16=True, fp16=True)
    # the same batch policy as train.py: another world keeps the recipe's global batch, or is refused
    accum, note = recipe_accumulation(Layout.from_ds_config(raw, world), raw, recipe.train.micro_batch_size,
                                      recipe.train.grad_accum_steps, recipe.world_size, args.world_size)
    train = replace(recipe.train, grad_accum_steps=accum)
    cfg = ds_config.resolve(raw, replace(recipe, train=train), world, caps, hidden)
    layout = Layout.from_ds_config(cfg, world)
    return (f"{layout.describe()}; global batch {cfg['train_batch_size']} = micro "
            f"{train.micro_batch_size} x accum {train.grad_accum_steps} x data-parallel {layout.data_parallel}"
            + (f" ({note})" if note else ""))


def check(hostfile: str, ssh_port: int | None, no_ssh: bool, train_argv: list[str]) -> list[str]:
    """Problems found (empty when the launch can go ahead); prints what was checked."""
    try:
        hosts = parse_hostfile(hostfile)
    except UserError as e:
        return [str(e)]
    world = sum(h.slots for h in hosts)
    print(f"cluster check: {len(hosts)} hosts, {world} ranks: "
          + ", ".join(f"{h.name}:{h.slots}" for h in hosts))
    problems = [] if no_ssh else ssh_problems(hosts, ssh_port)
    if not no_ssh and not problems:
        print(f"cluster check: ssh reaches all {len(hosts)} hosts")
    try:
        print(f"cluster check: {world_report(world, train_argv)}")
    except UserError as e:
        problems.append(str(e))
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dstrain.cluster", description=__doc__.split("\n\n")[0],
                                     allow_abbrev=False)
    parser.add_argument("--hostfile", required=True)
    parser.add_argument("--ssh_port", type=int, default=None)
    parser.add_argument("--no_ssh", action="store_true", help="nodes are started without ssh: skip the ssh probe")
    args, train_argv = parser.parse_known_args(argv)
    problems = check(args.hostfile, args.ssh_port, args.no_ssh, train_argv)
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    return EXIT_USER_ERROR if problems else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())

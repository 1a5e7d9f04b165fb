"""DeepSpeed's checkpoints: the universal checkpoint (its converter's inputs and outputs, the loaders' slips, every
stage's loader served), Muon's state through it, and the checkpoint engine the background saves write through."""
from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch


@contextmanager
def universal_load_repairs(engine, universal: bool, folder: Path | None = None) -> Iterator[None]:
    """Around engine.load_checkpoint of a universal checkpoint (`folder`), mend two slips of DeepSpeed's ZeRO-3
    universal loader: every param group gets group 0's hyperparameters (each group's own restored here: its saved
    ones from the folder's zero/optimizer_state.pt when it has them, else its weight decay as built), and one `step`
    tensor is shared by all sub-groups, each adding 1 (cloned here). A Muon checkpoint's momentum is put where
    DeepSpeed's Muon keeps it (muon_universal_load)."""
    groups = getattr(engine.optimizer, "optimizer", engine.optimizer).param_groups
    decays = [group.get("weight_decay") for group in groups]
    yield
    if not universal:
        return
    saved = None
    if folder is not None and (folder / "zero" / "optimizer_state.pt").is_file():
        saved = torch.load(folder / "zero" / "optimizer_state.pt", weights_only=False).get("param_groups")
    for index, (group, decay) in enumerate(zip(groups, decays)):
        if saved and len(saved) == len(groups):  # the hyperparameters this group was saved with (Muon's differ)
            group.update({key: value for key, value in saved[index].items() if key != "params"})
        else:
            group["weight_decay"] = decay
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    for state in inner.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()
    if folder is not None:
        muon_universal_load(engine, folder)


ANY_STAGE = "dstrain_any_stage.json"  # in a universal folder: universal_for_any_stage has completed it
_MODEL_STATES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")


def universal_for_any_stage(folder: Path) -> None:
    """Make a universal folder (ds_to_universal's output) loadable under every ZeRO stage, not only its source's.
    DeepSpeed 0.19.8 writes two things in the source stage's own form:
      - the model-states file, from which the universal loader reads only step counters, the LR schedule and the
        client state (the weights come from zero/): ZeRO-0/1/2 look for mp_rank_00_..., ZeRO-3 for
        zero_pp_rank_0_mp_rank_00_..., so a folder from another stage is found by neither (an empty AssertionError
        in state_dict_factory). Both names are given here, hard links to one file;
      - zero/optimizer_state.pt: ZeRO-1/2's loader reads its top-level `param_groups` and `ds_version`, ZeRO-3's its
        nested `optimizer_state_dict` ('state'[0]['step'], 'param_groups'; KeyError otherwise). Each form is
        completed with the other's keys, the step from the parameters' own step.pt;
      - each parameter's state: from ZeRO-1/2 a {'param': tensor of the parameter's shape} per file and a step.pt,
        from ZeRO-3 a bare flat tensor and no step.pt. ZeRO-3's loader reads both forms, ZeRO-1/2's only the first
        (IndexError: too many indices), so ZeRO-3's are rewritten in it, shaped by the model-states file's
        param_shapes, with the optimizer's step beside them."""
    import deepspeed

    done = folder / ANY_STAGE
    if done.is_file():  # completed once: a resume from an existing folder reads no parameter file again
        return
    present = [name for name in _MODEL_STATES if (folder / name).is_file()]
    for name in _MODEL_STATES:
        if present and not (folder / name).exists():
            os.link(folder / present[0], folder / name)
    path = folder / "zero" / "optimizer_state.pt"
    if not path.is_file():
        done.write_text("{}\n")
        return
    sd = torch.load(path, weights_only=False)
    nested = sd.get("optimizer_state_dict")
    groups = sd.get("param_groups") or (nested or {}).get("param_groups")
    changed = False
    if nested is None and groups is not None:
        steps = sorted(folder.glob("zero/*/step.pt"))
        step = torch.load(steps[0], weights_only=False) if steps else None
        sd["optimizer_state_dict"] = {"state": {0: {"step": step}}, "param_groups": groups}
        changed = True
    step = ((sd.get("optimizer_state_dict") or {}).get("state") or {}).get(0, {}).get("step")
    shapes = _param_shapes(folder) if present else {}
    # one converter wrote every file in one form: the first parameter's fp32.pt says whether any needs rewriting
    first = next((file for file in (folder / "zero" / name / "fp32.pt" for name in shapes) if file.is_file()), None)
    if first is None or not torch.is_tensor(torch.load(first, weights_only=False)):
        shapes = {}
    for name, shape in shapes.items():
        where = folder / "zero" / name
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            file = where / f"{key}.pt"
            if not file.is_file():
                continue
            value = torch.load(file, weights_only=False)
            if torch.is_tensor(value):
                numel = math.prod(shape)
                _save_replacing(file, {"param": value.reshape(-1)[:numel].reshape(tuple(shape))})
        if step is not None and (where / "exp_avg.pt").is_file() and not (where / "step.pt").exists():
            _save_replacing(where / "step.pt", torch.as_tensor(step).clone())
    if "param_groups" not in sd and groups is not None:
        sd["param_groups"] = groups
        changed = True
    if not sd.get("ds_version"):
        sd["ds_version"] = deepspeed.__version__
        changed = True
    if changed:
        _save_replacing(path, sd)
    done.write_text("{}\n")


def _save_replacing(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _universal_tensor(file: Path) -> torch.Tensor:
    value = torch.load(file, weights_only=False)
    return value["param"] if isinstance(value, dict) else value


def load_universal_into_plain_optimizer(engine, folder: Path) -> str:
    """Load a universal checkpoint (DeepSpeed's ds_to_universal output) into an engine whose optimizer is the plain
    PyTorch one (ZeRO-0 in fp32). DeepSpeed's universal loader lives in its ZeRO and BF16 optimizers only: under
    ZeRO-0 `engine.load_checkpoint` skips the weights of a universal folder and hands the PyTorch optimizer `None`
    (AttributeError: 'NoneType' object has no attribute 'copy'). Each parameter's fp32 weight and Adam moments are
    read from zero/<name>/, the step count, the LR schedule and the engine's counters from the folder's
    mp_rank_00_model_states.pt, and each group's learning rate is the schedule's last one (DeepSpeed steps the
    schedule after the optimizer, so the first resumed step uses what the group holds). Returns the folder."""
    states = torch.load(folder / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    optimizer = engine.optimizer
    names = {id(p): name for name, p in engine.module.named_parameters()}
    for group in optimizer.param_groups:
        for param in group["params"]:
            name = names[id(param)]
            where = folder / "zero" / name
            if not (where / "fp32.pt").is_file():
                raise FileNotFoundError(f"{where / 'fp32.pt'}: the universal checkpoint lacks parameter {name}")
            with torch.no_grad():
                param.copy_(_universal_tensor(where / "fp32.pt").view_as(param))
            if (where / "exp_avg.pt").is_file():
                step = torch.load(where / "step.pt", weights_only=False) if (where / "step.pt").is_file() else None
                optimizer.state[param] = {
                    "step": torch.tensor(float(step if step is not None else states["global_steps"])),
                    "exp_avg": _universal_tensor(where / "exp_avg.pt").view_as(param).clone(),
                    "exp_avg_sq": _universal_tensor(where / "exp_avg_sq.pt").view_as(param).clone()}
    if engine.lr_scheduler is not None and states.get("lr_scheduler") is not None:
        engine.lr_scheduler.load_state_dict(states["lr_scheduler"])
        for group, lr in zip(optimizer.param_groups, engine.lr_scheduler.get_last_lr()):
            group["lr"] = lr
    engine.global_steps = states["global_steps"]
    engine.global_samples = states.get("global_samples", engine.global_steps * engine.train_batch_size())
    engine.skipped_steps = states["skipped_steps"]
    return str(folder)


MUON_UNIVERSAL = "muon.json"  # in a universal folder: the parameters whose exp_avg.pt is Muon's momentum


def muon_universal_input(checkpoint: Path, shadow: Path) -> list[str] | None:
    """DeepSpeed 0.19.8's universal converter (ds_to_universal) reads `exp_avg` and `exp_avg_sq` from every
    optimizer group and fails on Muon's (`KeyError: 'exp_avg'`): its groups hold one `momentum_buffer`. For a
    checkpoint with Muon state this writes `shadow`, the checkpoint's files linked, its optimizer files rewritten
    so the converter accepts them, and returns the Muon parameters' names (None: no Muon state, convert the
    checkpoint itself). The converted folder then holds each Muon parameter's full momentum as its exp_avg.pt
    (muon_universal_output) and zeros as exp_avg_sq.pt.

    ZeRO-3, and ZeRO-1/2 with CPU offload, keep Muon's momentum laid out as the fp32 partition
    (stage3._muon_update_sub_group, stage_1_and_2._apply_muon_updates_cpu_offload): it becomes the group's exp_avg
    as it is. ZeRO-1/2 without offload keep, per Muon group, the FULL momentum of every parameter that has any
    element in the rank's partition, one after another in the partition's order (stage_1_and_2.get_flat_partition:
    Newton-Schulz needs whole matrices): the group gets zeros of the partition's size, and the full momenta are
    cut from the buffer by the parameters' shapes (the model states' param_shapes) and written afterwards."""
    files = sorted(checkpoint.glob("*optim_states.pt"))
    first = torch.load(files[0], map_location="cpu", weights_only=False) if files else None
    if first is None or not any("momentum_buffer" in s for s in _optimizer_states(first).values()):  # every rank
        return None  # has the same groups
    shadow.mkdir(parents=True)
    for item in checkpoint.iterdir():
        if item not in files:
            (shadow / item.name).symlink_to(item.resolve())
    shapes = _param_shapes(checkpoint)
    momenta = shadow / "muon_momenta"  # one file per parameter: a rank's file at a time in memory
    momenta.mkdir()
    names = []
    for file in files:
        sd, first = first or torch.load(file, map_location="cpu", weights_only=False), None  # the first read once
        osd = sd["optimizer_state_dict"]
        states = _optimizer_states(sd)
        for index, state in list(states.items()):
            if "momentum_buffer" not in state:
                continue
            buffer = state.pop("momentum_buffer")
            partition = osd["single_partition_of_fp32_groups"][index] if "base_optimizer_state" in osd else None
            if partition is not None and buffer.numel() == partition.numel():  # ZeRO-1/2 with CPU offload
                names += list(osd["param_slice_mappings"][index])  # (_apply_muon_updates_cpu_offload): as the
                state.update(exp_avg=buffer, exp_avg_sq=torch.zeros_like(buffer))  # partition, like ZeRO-3
            elif partition is not None:  # ZeRO-1/2: full momenta of the partition's parameters
                offset = 0
                for name in osd["param_slice_mappings"][index]:
                    numel = shapes[name].numel()
                    if name not in names:
                        torch.save(buffer[offset:offset + numel].clone(), momenta / f"{len(names)}.pt")
                        names.append(name)
                    offset += numel
                state.update(exp_avg=torch.zeros_like(partition), exp_avg_sq=torch.zeros_like(partition))
            else:  # ZeRO-3: the momentum is laid out as the partition; its loader reads sub-group 0's `step`
                names += [name for name in _zero3_group_names(checkpoint, file, index)]
                step = next((s["step"] for s in states.values() if "step" in s), torch.tensor(0.0))
                state.update(exp_avg=buffer, exp_avg_sq=torch.zeros_like(buffer), step=step)
        torch.save(sd, shadow / file.name)
        del sd, osd, states
    (momenta / "names.json").write_text(json.dumps(names))
    return sorted(set(names))


def muon_universal_output(shadow: Path, out: Path, names: list[str]) -> None:
    """After ds_to_universal converted `shadow`: ZeRO-1/2's full momenta written as the Muon parameters'
    exp_avg.pt, and the list of Muon parameters saved beside them (muon.json)."""
    momenta = shadow / "muon_momenta"
    for index, name in enumerate(json.loads((momenta / "names.json").read_text())):
        if not (momenta / f"{index}.pt").is_file():  # laid out as the partition: converted as it was
            continue
        momentum = torch.load(momenta / f"{index}.pt", weights_only=False)
        path = out / "zero" / name / "exp_avg.pt"
        entry = torch.load(path, weights_only=False)
        assert entry["param"].numel() == momentum.numel(), (name, entry["param"].shape, momentum.shape)
        entry["param"] = momentum.view(entry["param"].shape).to(entry["param"].dtype)
        torch.save(entry, path)
    (out / MUON_UNIVERSAL).write_text(json.dumps(names))


def muon_universal_load(engine, folder: Path) -> None:
    """After DeepSpeed's universal loader filled a Muon group's state as AdamW's (exp_avg = the momentum,
    exp_avg_sq = zeros): the momentum put where DeepSpeed's Muon reads it. ZeRO-3 and ZeRO-1/2 with CPU
    offload: the group's `momentum_buffer`, in the partition's layout, as loaded. ZeRO-1/2: the full momentum of
    every parameter of the rank's partition, concatenated in the partition's order (read whole from the folder:
    a rank holds only a fragment of a parameter that straddles two partitions)."""
    listed = folder / MUON_UNIVERSAL
    if not listed.is_file():
        return
    optimizer = engine.optimizer
    inner = optimizer.optimizer
    if hasattr(optimizer, "sub_groups_using_muon"):  # ZeRO-3
        for index, muon in enumerate(optimizer.sub_groups_using_muon):
            if muon:
                state = inner.state[optimizer.fp32_partitioned_groups_flat[index]]
                state["momentum_buffer"] = state.pop("exp_avg")
                state.pop("exp_avg_sq", None)
        return
    for index, params in enumerate(optimizer.params_in_partition):
        if not params or not getattr(params[0], "use_muon", False):
            continue
        flat = inner.param_groups[index]["params"][0]
        state = inner.state[flat]
        momentum = state.pop("exp_avg", None)
        state.pop("exp_avg_sq", None)
        if optimizer.cpu_offload:  # laid out as the partition (_apply_muon_updates_cpu_offload), as loaded
            state["momentum_buffer"] = momentum
            continue
        state["momentum_buffer"] = torch.cat([
            torch.load(folder / "zero" / optimizer.param_names[p] / "exp_avg.pt", weights_only=False)["param"]
            .flatten().float() for p in params]).to(flat.device)


def _optimizer_states(sd: dict) -> dict:
    osd = sd["optimizer_state_dict"]
    return (osd["base_optimizer_state"] if "base_optimizer_state" in osd else osd["optimizer_state_dict"])["state"]


def _param_shapes(checkpoint: Path) -> dict:
    shapes = {}
    for file in sorted(checkpoint.glob("*model_states.pt")):
        for group in torch.load(file, map_location="cpu", weights_only=False)["param_shapes"]:
            shapes.update(group)
        break  # ZeRO-1/2 have one; ZeRO-3's first rank lists every parameter too
    return shapes


def _zero3_group_names(checkpoint: Path, optim_file: Path, index: int) -> list[str]:
    model_file = optim_file.with_name(optim_file.name.replace("optim_states", "model_states"))
    return list(torch.load(model_file, map_location="cpu", weights_only=False)["param_shapes"][index])


def checkpoint_engine_base() -> type:
    """DeepSpeed's plain checkpoint engine class (torch.save per file), for a subclass that writes differently
    (dstrain/run/background_save.py). deepspeed.runtime.checkpoint_engine is undocumented."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    return TorchCheckpointEngine


@contextmanager
def using_checkpoint_engine(engine, checkpoint_engine) -> Iterator[None]:
    """engine.save_checkpoint writes every file through engine.checkpoint_engine.save(state_dict, path): swapped
    for one save, then the engine's own put back. DeepSpeedEngine.checkpoint_engine is not public."""
    own = engine.checkpoint_engine
    engine.checkpoint_engine = checkpoint_engine
    try:
        yield
    finally:
        engine.checkpoint_engine = own

"""What the real-model runners share: the weight tensors of torch modules, checked in-place
reloads from safetensors, and the residency check before a request.

A reload writes into the tensors the worker's backend already tracks, so it must not start
unless it can finish: `WeightSet.plan` reads every safetensors header of the source (shape
and dtype, no data) and compares it with what the runner loaded, and only a complete,
matching plan is executed. A mismatch raises `RunnerArgumentError` naming the first tensor,
which the worker answers with NACK INVALID_ARGUMENT, weights untouched.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from omni_core.runners.base import RunnerArgumentError

log = logging.getLogger("omni_core.runners")

# How many problems a refused reload lists after the first one.
MAX_PROBLEMS_SHOWN = 5


@dataclass(frozen=True)
class HeaderEntry:
    file: Path
    shape: tuple[int, ...]
    dtype: str  # safetensors' name: F32, BF16, ...


@dataclass(frozen=True)
class ReloadReport:
    source: str
    reload_bytes: int
    tensors: int
    duration_s: float

    @property
    def gb_per_s(self) -> float:
        return self.reload_bytes / self.duration_s / 1e9 if self.duration_s > 0 else float("inf")


@dataclass
class _Target:
    names: tuple[str, ...]  # checkpoint names of one tensor: tied weights have several
    tensor: torch.Tensor
    source_dtype: str = ""  # dtype in the runner's own checkpoint; a reload must match it


def resolved(path: Path | str) -> Path:
    """`path` with every symlink resolved, once: a reload checks, plans and reads this path and
    never resolves the caller's again (a link swapped in between would be followed)."""
    try:
        return Path(os.path.realpath(path))
    except (ValueError, OSError) as exc:  # a NUL in the path, a loop of links
        raise RunnerArgumentError(
            f"the reload source {str(path)!r} is not a usable path ({exc}); give a checkpoint directory path"
        ) from None


@contextlib.contextmanager
def opened_without_links(path: Path) -> Iterator[str]:
    """A name that opens exactly the file at the resolved `path`: it is opened one component at
    a time, refusing a symlink at each (O_NOFOLLOW), and read through /proc/self/fd. A path
    that became a link after it was resolved is refused (RunnerArgumentError), not followed.
    Where /proc/self/fd is missing, only the last component is checked."""
    fd = -1
    try:
        if os.path.isdir("/proc/self/fd"):
            fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            parts = path.parts[1:]
            for index, part in enumerate(parts):
                last = index == len(parts) - 1
                flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | (0 if last else os.O_DIRECTORY)
                next_fd = os.open(part, flags, dir_fd=fd)
                os.close(fd)
                fd = next_fd
            yield f"/proc/self/fd/{fd}"
        else:  # pragma: no cover - Linux has /proc
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            yield str(path)
    except OSError as exc:
        raise RunnerArgumentError(
            f"cannot open {str(path)!r} without following a symlink ({exc}): the source "
            "changed after it was checked; reload again from a directory nobody swaps"
        ) from None
    finally:
        if fd >= 0:
            os.close(fd)


def safetensors_files(directory: Path) -> list[Path]:
    """The resolved paths of the checkpoint's files (symlinks, as in a hub cache, resolved once)."""
    directory = resolved(directory)
    if not directory.is_dir():
        raise RunnerArgumentError(
            f"weights directory {str(directory)!r} does not exist or is not a directory; "
            "give a local checkpoint directory (config + *.safetensors)"
        )
    files = [resolved(f) for f in sorted(directory.glob("*.safetensors"))]
    if not files:
        raise RunnerArgumentError(
            f"{str(directory)!r} holds no *.safetensors file; reloads read safetensors "
            "only (convert a .bin checkpoint with save_pretrained(safe_serialization=True))"
        )
    return files


def read_headers(directory: Path) -> dict[str, HeaderEntry]:
    """Name -> (file, shape, dtype) of every tensor of a checkpoint directory; reads no data."""
    from safetensors import safe_open

    headers: dict[str, HeaderEntry] = {}
    for path in safetensors_files(directory):
        try:
            with opened_without_links(path) as name_of_file, safe_open(name_of_file, framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                    if name in headers:
                        raise RunnerArgumentError(
                            f"tensor {name!r} is in both {headers[name].file.name} and "
                            f"{path.name} under {str(directory)!r}"
                        )
                    piece = f.get_slice(name)
                    headers[name] = HeaderEntry(path, tuple(piece.get_shape()), piece.get_dtype())
        except RunnerArgumentError:
            raise
        except Exception as exc:  # a truncated or foreign file: refuse before writing anything
            raise RunnerArgumentError(f"cannot read the safetensors header of {str(path)!r}: {exc}") from None
    return headers


def _model_type(directory: Path) -> str | None:
    for name in ("config.json", "model_index.json"):
        path = directory / name
        if path.is_file():
            try:
                config = json.loads(path.read_text())
            except (OSError, ValueError):
                return None
            return config.get("model_type") or config.get("_class_name")
    return None


class WeightSet:
    """The persistent tensors of some modules, by checkpoint folder and name.

    `folders` maps a checkpoint sub-folder ("" for a transformers model, "transformer",
    "vae", ... for a diffusers pipeline) to the module whose state dict it holds.
    """

    def __init__(self, folders: Mapping[str, torch.nn.Module]) -> None:
        self.own_directory: Path | None = None
        self.folders: dict[str, list[_Target]] = {}
        for folder, module in folders.items():
            by_identity: dict[int, _Target] = {}
            for name, tensor in module.state_dict(keep_vars=True).items():
                target = by_identity.get(id(tensor))
                if target is None:
                    by_identity[id(tensor)] = _Target((name,), tensor)
                else:
                    target.names = (*target.names, name)
            self.folders[folder] = list(by_identity.values())

    def bind_source(self, directory: Path) -> None:
        """Check the checkpoint the modules were loaded from and remember its dtypes: later
        reloads must bring the same tensors in the same format."""
        self.own_directory = directory
        for folder, targets in self.folders.items():
            headers = read_headers(directory / folder)
            for target, _, entry in self._match(folder, targets, headers, directory, check_dtype=False):
                target.source_dtype = entry.dtype

    def bind_own_dtypes(self) -> None:
        """No checkpoint was read (load_format 'dummy'): a reload must bring the dtypes the
        modules hold."""
        for targets in self.folders.values():
            for target in targets:
                target.source_dtype = SAFETENSORS_NAMES[target.tensor.dtype]

    def plan(self, directory: Path) -> list[tuple[_Target, str, HeaderEntry]]:
        """Every (tensor, checkpoint name, header) a reload from `directory` writes; raises
        RunnerArgumentError on the first mismatch, before anything is read or written."""
        steps = []
        for folder, targets in self.folders.items():
            headers = read_headers(directory / folder)
            steps.extend(self._match(folder, targets, headers, directory, check_dtype=True))
        return steps

    def _match(
        self, folder: str, targets: list[_Target], headers: dict[str, HeaderEntry], directory: Path, check_dtype: bool
    ) -> list[tuple[_Target, str, HeaderEntry]]:
        where = f"{folder}/" if folder else ""
        problems: list[str] = []
        steps = []
        for target in targets:
            name = next((n for n in target.names if n in headers), None)
            if name is None:
                problems.append(f"tensor {where}{target.names[0]!r} is missing")
                continue
            entry = headers[name]
            shape = tuple(target.tensor.shape)
            if entry.shape != shape:
                problems.append(f"tensor {where}{name!r} has shape {list(entry.shape)}, the model's is {list(shape)}")
            elif check_dtype and entry.dtype != target.source_dtype:
                problems.append(
                    f"tensor {where}{name!r} is {entry.dtype}, the loaded checkpoint's is {target.source_dtype}"
                )
            else:
                steps.append((target, name, entry))
        known = {n for t in targets for n in t.names}
        problems.extend(f"tensor {where}{name!r} is not in this model" for name in headers if name not in known)
        if problems:
            ours = _model_type(self.own_directory) if self.own_directory is not None else None
            theirs = _model_type(directory)
            hint = f" (the source is a {theirs!r})" if theirs and theirs != ours else ""
            more = (
                f"; and {len(problems) - 1} more problem(s): {problems[1 : 1 + MAX_PROBLEMS_SHOWN]}"
                if len(problems) > 1
                else ""
            )
            raise RunnerArgumentError(
                f"cannot load weights from {str(directory)!r}{hint}: {problems[0]}{more}; "
                "it must be a checkpoint of the same architecture and dtype"
            )
        return steps

    def load(self, directory: Path) -> ReloadReport:
        """Validate everything, then copy in place; returns what was moved and how fast."""
        from safetensors import safe_open

        steps = self.plan(directory)
        started = time.perf_counter()
        reload_bytes = 0
        by_file: dict[Path, list[tuple[_Target, str]]] = {}
        for target, name, entry in steps:
            by_file.setdefault(entry.file, []).append((target, name))
        with torch.no_grad(), contextlib.ExitStack() as files:
            # Every file opened before the first write: a source swapped since the plan is
            # refused while the weights are still untouched.
            opened = {path: files.enter_context(opened_without_links(path)) for path in by_file}
            for path, items in by_file.items():
                with safe_open(opened[path], framework="pt", device="cpu") as f:
                    for target, name in items:
                        piece = rank_shard(target.tensor, f.get_tensor(name))
                        local_tensor(target.tensor).copy_(piece)  # casts when the runner computes in another dtype
                        reload_bytes += piece.numel() * piece.element_size()
        devices = {d for d in (local_tensor(t.tensor).device for t, _, _ in steps) if d.type == "cuda"}
        for device in devices:  # the copies are asynchronous from pinned memory only, but be exact
            torch.cuda.synchronize(device)
        report = ReloadReport(str(directory), reload_bytes, len(steps), time.perf_counter() - started)
        log.info(
            "reloaded %d tensors, %.1f MiB from %s in %.3f s (%.2f GB/s)",
            report.tensors,
            reload_bytes / 2**20,
            directory,
            report.duration_s,
            report.gb_per_s,
        )
        return report

    def tensors(self) -> list[torch.Tensor]:
        return [t.tensor for targets in self.folders.values() for t in targets]

    def _by_name(self) -> dict[str, _Target]:
        return {
            (f"{folder}/{name}" if folder else name): target
            for folder, targets in self.folders.items()
            for target in targets
            for name in target.names
        }

    def named(self) -> dict[str, torch.Tensor]:
        """Name -> tensor of every weight (tied weights once, under their first name)."""
        return {
            (f"{folder}/{t.names[0]}" if folder else t.names[0]): t.tensor
            for folder, targets in self.folders.items()
            for t in targets
        }

    def save(self, directory: Path, max_file_bytes: int, stems: Mapping[str, str] | None = None) -> list[str]:
        """Write every weight into `directory` (a sub-folder per folder) as `load` reads it back:
        tied weights once, under their first name, each in its checkpoint's dtype; a folder's
        files named `stems[folder]` (default `model`, transformers' name). Returns the files
        written, relative to `directory`."""
        files: list[str] = []
        for folder, targets in self.folders.items():
            tensors = {t.names[0]: t.tensor for t in targets}
            dtypes = {t.names[0]: SAFETENSORS_DTYPES[t.source_dtype] for t in targets if t.source_dtype}
            stem = (stems or {}).get(folder, "model")
            written = write_safetensors(directory / folder, tensors, max_file_bytes, dtypes=dtypes, stem=stem)
            files.extend(f"{folder}/{name}" if folder else name for name in written)
        return files

    def specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Name -> full (unsharded) shape and dtype of every tensor an update may write: the
        state_dict names (tied weights under each of theirs), `folder/name` in a sub-folder."""
        return {name: (tuple(t.tensor.shape), t.tensor.dtype) for name, t in self._by_name().items()}

    def write(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy full tensors in place, each rank its shard (as a reload cuts it); the names,
        shapes and dtypes were checked against `specs`. Returns the bytes written here."""
        targets = self._by_name()
        written_bytes = 0
        with torch.no_grad():
            for name, full in named:
                target = targets[name]
                piece = rank_shard(target.tensor, full)
                local_tensor(target.tensor).copy_(piece)
                written_bytes += piece.numel() * piece.element_size()
        return written_bytes


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The memory this rank holds for `tensor`: a DTensor's own shard (the very tensor object,
    not a view, so that replacing its `.data` replaces the shard), any other tensor itself."""
    from torch.distributed.tensor import DTensor

    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def _unreloadable(placements: Iterable[object]) -> list[object]:
    """The placements `rank_shard` cannot cut: all but Shard(dim) (exactly, not a strided
    subclass) and Replicate."""
    from torch.distributed.tensor import Replicate, Shard

    return [p for p in placements if type(p) is not Shard and not isinstance(p, Replicate)]


def check_placements(model: torch.nn.Module) -> None:
    """Refuse at load a tensor-parallel sharding a reload could not reproduce."""
    from torch.distributed.tensor import DTensor

    for name, tensor in model.state_dict(keep_vars=True).items():
        odd = _unreloadable(tensor.placements) if isinstance(tensor, DTensor) else []
        if odd:
            raise ValueError(
                f"transformers' tensor-parallel plan placed {name!r} as {odd[0]}; this runner "
                "reloads Shard and Replicate placements only; run this model with one rank"
            )


def rank_shard(target: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of a checkpoint tensor `full` for `target`: for a tensor-parallel
    DTensor the block its placements give this rank, otherwise `full`.

    Cut on the host as DTensor cuts (`torch.chunk` along a Shard's dim): every rank reads the
    checkpoint itself, so no communication, and the whole tensor never lands on the device
    (a temporary there would come out of the pool being reloaded).
    """
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(target, DTensor):
        return full
    odd = _unreloadable(target.placements)
    if odd:
        raise RuntimeError(
            f"cannot reload a tensor of shape {tuple(target.shape)} placed as {odd[0]}: only "
            "Shard and Replicate placements are supported (checked at load)"
        )
    mesh, piece = target.device_mesh, full
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise RuntimeError(f"this rank is not in the device mesh of a tensor of shape {tuple(target.shape)}")
    for mesh_dim, placement in enumerate(target.placements):
        if type(placement) is Shard:  # Replicate: the whole tensor along this mesh dimension
            chunks = torch.chunk(piece, mesh.size(mesh_dim), dim=placement.dim)
            index = coordinate[mesh_dim]
            piece = chunks[index] if index < len(chunks) else piece.narrow(placement.dim, 0, 0)
    if tuple(piece.shape) != tuple(target.to_local().shape):
        raise RuntimeError(
            f"the shard of a tensor of shape {tuple(full.shape)} is {tuple(piece.shape)} here, "
            f"the model's is {tuple(target.to_local().shape)}"
        )
    return piece


def module_tensors(modules: Iterable[torch.nn.Module]) -> list[torch.Tensor]:
    """Every parameter and buffer, each once (tied weights share one tensor); of a
    tensor-parallel model each rank's shard, which is the memory a backend sleeps and wakes."""
    seen: set[int] = set()
    out = []
    for module in modules:
        for tensor in [*module.parameters(), *module.buffers()]:
            if id(tensor) not in seen:
                seen.add(id(tensor))
                out.append(local_tensor(tensor))
    return out


def non_persistent_buffers(modules: Mapping[str, torch.nn.Module]) -> dict[str, torch.Tensor]:
    """Buffers that are not in the state dict (rotary inv_freq, sin-cos position tables):
    computed at construction, so a reload cannot bring them back after a level-2 sleep."""
    out = {}
    for prefix, module in modules.items():
        persistent = set(module.state_dict(keep_vars=True))
        for name, buffer in module.named_buffers():
            if name not in persistent:
                out[f"{prefix}.{name}" if prefix else name] = buffer
    return out


def own_storage(modules: Iterable[torch.nn.Module]) -> int:
    """Give every tensor memory of its own; returns how many were copied.

    Loading safetensors on CPU maps the file: tensors then view read-only file pages that a
    memory backend cannot release or restore in place (not resizable). Copying them here,
    inside the weights pool, makes the pool own every byte of the model.
    """
    copied = 0
    with torch.no_grad():
        for tensor in module_tensors(modules):
            if not tensor.untyped_storage().resizable():
                tensor.data = tensor.data.clone()
                copied += 1
    return copied


def check_resident(tensors_by_tag: Mapping[str, Iterable[torch.Tensor]]) -> None:
    """Refuse to compute on a released tensor: on CPU it reads freed memory, on a GPU
    garbage. The worker's state machine already refuses Execute unless every tag is
    resident; this guards direct use of a runner. One storage size per tensor."""
    for tag, tensors in tensors_by_tag.items():
        for t in tensors:
            if t.untyped_storage().nbytes() < (t.storage_offset() + t.numel()) * t.element_size():
                raise RuntimeError(
                    f"a {tag} tensor of shape {tuple(t.shape)} holds no memory: its pool is "
                    "asleep; wake the stage (every tag) before executing"
                )


def torch_threads(device: torch.device, cpu_threads: int | None) -> None:
    if cpu_threads is not None and device.type == "cpu":
        # Small models on a loaded machine: intra-op threads wait on each other for whole
        # scheduler slices; one thread is faster and its results do not depend on the load.
        torch.set_num_threads(cpu_threads)


# safetensors' dtype names, as a header gives them, to torch's: a save writes each weight in
# the dtype of the checkpoint it was loaded from, so that a reload of the save matches it.
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
SAFETENSORS_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


def saved_form(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """What a save writes of `tensor`: this rank's memory of it, on the host, contiguous, in
    `dtype` (None: its own), never sharing memory with the weights (a save reads, never moves)."""
    return local_tensor(tensor).detach().to("cpu", dtype=dtype or tensor.dtype, copy=True).contiguous()


def file_groups(sizes: Mapping[str, int], max_file_bytes: int) -> list[list[str]]:
    """The names in order, cut into files of at most `max_file_bytes` each (a tensor larger than
    that alone in its file), as vLLM's save_sharded_state cuts its parts."""
    groups: list[list[str]] = [[]]
    used = 0
    for name, nbytes in sizes.items():
        if groups[-1] and used + nbytes > max_file_bytes:
            groups.append([])
            used = 0
        groups[-1].append(name)
        used += nbytes
    return [g for g in groups if g]


def write_safetensors(
    directory: Path,
    tensors: Mapping[str, torch.Tensor],
    max_file_bytes: int,
    *,
    dtypes: Mapping[str, torch.dtype] | None = None,
    stem: str = "model",
) -> list[str]:
    """Write `tensors` (each in `dtypes[name]` where given) into `directory` as transformers
    names a checkpoint: `{stem}.safetensors`, or `{stem}-0000i-of-0000n.safetensors` parts with
    `{stem}.safetensors.index.json`, each file at most `max_file_bytes` (one tensor larger than
    that alone). Tensors come to the host one file at a time. Returns the file names."""
    from safetensors.torch import save_file

    dtypes = dtypes or {}
    directory.mkdir(parents=True, exist_ok=True)
    sizes = {name: t.numel() * (dtypes.get(name) or t.dtype).itemsize for name, t in tensors.items()}
    groups = file_groups(sizes, max_file_bytes) or [[]]  # no tensor at all: still one file
    names = (
        [f"{stem}.safetensors"]
        if len(groups) == 1
        else [f"{stem}-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    )
    weight_map: dict[str, str] = {}
    for file_name, group in zip(names, groups, strict=True):
        host = {name: saved_form(tensors[name], dtypes.get(name)) for name in group}
        save_file(host, str(directory / file_name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(group, file_name))
    if len(names) > 1:
        index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
        (directory / f"{stem}.safetensors.index.json").write_text(json.dumps(index, indent=1))
        names.append(f"{stem}.safetensors.index.json")
    return names


def read_saved(
    directory: Path, specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Name -> host tensor of every weight in `specs` from a saved directory (what
    `write_safetensors` wrote), once every header is checked: exactly these names, shapes and
    dtypes, else RunnerArgumentError before the first tensor is read (so before any write)."""
    from safetensors import safe_open

    directory = resolved(directory)
    headers = read_headers(directory)
    problems = [f"tensor {name!r} is missing" for name in specs if name not in headers]
    problems += [f"tensor {name!r} is not a weight of this runner" for name in headers if name not in specs]
    for name, (shape, dtype) in specs.items():
        entry = headers.get(name)
        if entry is not None and (entry.shape != shape or SAFETENSORS_NAMES.get(dtype) != entry.dtype):
            problems.append(
                f"tensor {name!r} is {entry.dtype} {list(entry.shape)}, the runner's is {dtype} {list(shape)}"
            )
    if problems:
        raise RunnerArgumentError(
            f"cannot load weights from {str(directory)!r}: {'; '.join(problems[:MAX_PROBLEMS_SHOWN])}; "
            "give a directory this runner saved (SaveWeights)"
        )
    for path in sorted({entry.file for entry in headers.values()}):
        with opened_without_links(path) as name_of_file, safe_open(name_of_file, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                yield name, f.get_tensor(name)

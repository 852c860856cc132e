"""The scenario language: one command per line, run on a `Simulator`, answered with the
transcript of what happened (the commands: `Script`)."""

from __future__ import annotations

import dataclasses
import json
import shlex
from collections.abc import Callable
from typing import Any

import msgspec
import msgspec.inspect

from omni_core.fsm import inputs as I
from omni_core.fsm.admission import AdmissionPolicy
from omni_core.fsm.stage import StageCommandError, StageCore, StageStep
from omni_core.fsm.stage_table import STATELESS
from omni_core.fsm.worker import WorkerCore
from omni_core.protocol import Capability, CollectiveSource, DiskSource, TensorSpec, WeightSource
from omni_testing.describe import fmt_s, fmt_tags
from omni_testing.network import ECHO, Envelope, Faults, SimulationError, Simulator


class ScriptError(ValueError):
    """A scenario line the interpreter cannot run (unknown command, bad argument)."""


def parse_duration_s(text: str) -> float:
    """'30s', '+5s', '250ms', '1.5' (seconds) -> seconds."""
    text = text.lstrip("+")
    try:
        if text.endswith("ms"):
            return float(text[:-2]) / 1000.0
        return float(text.removesuffix("s"))
    except ValueError:
        raise ScriptError(f"not a duration: {text!r} (write 30s, 250ms)") from None


def _value(text: str) -> Any:
    """A payload or output from a script: an int if it reads as one, else the text."""
    try:
        return int(text)
    except ValueError:
        return text


def _rank(text: str) -> int:
    try:
        return int(text.removeprefix("r"))
    except ValueError:
        raise ScriptError(f"not a rank: {text!r} (write 1 or r1)") from None


def _address(text: str) -> int | None:
    return None if text == "stage" else _rank(text)


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise ScriptError(f"not a yes/no: {text!r}")


def _load_errors(args: dict[str, str]) -> dict[int, str]:
    """`load-error=1:ModuleNotFoundError...`: rank 1's runner fails to load with that error."""
    if "load-error" not in args:
        return {}
    rank, _, error = args["load-error"].partition(":")
    return {_rank(rank): error or "the runner failed to load"}


def _weight_source(text: str) -> WeightSource:
    """`source=PATH` a checkpoint directory; `source=collective` a trainer's broadcast (a
    version that lives in memory only) of one tensor."""
    if text == "collective":
        return CollectiveSource(tensors=(TensorSpec(name="w0", dtype="float32", shape=(4,)),))
    return DiskSource(path=text)


def _tag_list(text: str) -> tuple[str, ...] | None:
    return None if text == "all" else tuple(t for t in text.split(",") if t)


class Script:
    """The scenario language: one command per line, run on a Simulator, answered with the
    transcript of what happened. The commands (arguments `key=value`, durations as `30s`):

    stage ranks=N [name= policy=queue|reject|wake queue-limit= max-in-flight= tags=a,b
          start-deadline= wake-deadline= hello=deliver|hold|none capabilities=level2,partial_wake
          shell=serial|async load-error=RANK:TEXT seed= + the fault options below]   a fresh simulation
    faults [loss= dup= delay= max-delay= reorder= crash= effect-error=]   seeded fault rates
    sleep task= [level=1 tags=all deadline=30s abort=false]   wake task= [tags= deadline=]
    reload task= [source= deadline=]     submit req= [payload= timeout=30s adapter=]     set-admission POLICY
    update task= version= [source=PATH|collective deadline=30s]   weight-group task= [port=29500 world=3 offset=1]
    share task= [bucket-bytes=1024 deadline=30s]
    profile task= [start=yes|no prefix= deadline=30s]
    command TYPE task= [deadline=30s FIELD=VALUE...]   a stateless command's generic call (CommandCall)
    pause task= [mode=wait|keep|abort deadline=30s]   resume task= [deadline=30s]
    restart [hello=deliver|hold|none load-error=RANK:TEXT from-checkpoint=no]
    stop     tick [+DURATION]   (advance the clock, then Tick)
    deliver [SELECT] [n=N|all]   drop [SELECT] [n=N|all]   dup [SELECT]   delay [SELECT] by=DURATION
    corrupt [SELECT]             deliver-all              settle
          SELECT: id= from=stage|rN to=stage|rN rank=N (from or to) type=Ack task=ID
    done [rank=N] [output=]      error rank=N [msg=]       refuse rank=N [msg=]
    crash rank=N [detail=]       block rank=N              unblock rank=N        status
    """

    def __init__(self) -> None:
        self.sim: Simulator | None = None
        self.start_deadline_s = 10.0

    def run(self, line: str) -> list[str]:
        words = shlex.split(line)
        if not words:
            raise ScriptError("empty command")
        name, rest = words[0], words[1:]
        args = dict(w.split("=", 1) for w in rest if "=" in w)
        bare = [w for w in rest if "=" not in w]
        handler = getattr(self, "cmd_" + name.replace("-", "_"), None)
        if handler is None:
            raise ScriptError(f"unknown command {name!r}")
        if name != "stage" and self.sim is None:
            raise ScriptError(f"{name}: no stage yet (start with `stage ranks=N`)")
        try:
            extra = handler(args, bare)
        except StageCommandError:
            extra = None  # recorded by Simulator.call; the scenario goes on
        except SimulationError as exc:
            extra = [f"error: {exc}"]
        except ScriptError:
            raise
        except (KeyError, ValueError) as exc:  # a missing argument, a policy or number that is none
            raise ScriptError(f"{name}: bad or missing argument: {exc}") from exc
        lines = (self.sim.take_lines() if self.sim is not None else []) + (extra or [])
        return lines or ["ok"]

    @property
    def s(self) -> Simulator:
        assert self.sim is not None
        return self.sim

    # ---------------------------------------------------------------- set-up

    def cmd_stage(self, args: dict[str, str], bare: list[str]) -> None:
        known = {
            "ranks",
            "name",
            "policy",
            "queue-limit",
            "max-in-flight",
            "tags",
            "start-deadline",
            "wake-deadline",
            "hello",
            "capabilities",
            "shell",
            "load-error",
            "seed",
            *_FAULT_KEYS,
        }
        self._only(args, known)
        tags = _tag_list(args["tags"]) if "tags" in args else None
        core: dict[str, Any] = {"policy": AdmissionPolicy(args.get("policy", "queue"))}
        if tags:
            core["tags"] = tags
        if "queue-limit" in args:
            core["queue_limit"] = int(args["queue-limit"])
        if "max-in-flight" in args:
            core["max_in_flight"] = int(args["max-in-flight"])
        if "wake-deadline" in args:
            core["wake_deadline_s"] = parse_duration_s(args["wake-deadline"])
        stage = StageCore(args.get("name", "talker"), int(args.get("ranks", "1")), **core)
        capabilities = (
            tuple(Capability(c) for c in args["capabilities"].split(",") if c) if "capabilities" in args else None
        )

        def make_worker(rank: int, epoch: int) -> WorkerCore:
            if capabilities is None:
                return WorkerCore(rank, tags=stage.tags, epoch=epoch)
            return WorkerCore(rank, tags=stage.tags, epoch=epoch, capabilities=capabilities)

        shell = args.get("shell", "serial")
        if shell not in ("serial", "async"):
            raise ScriptError(f"shell={shell}: serial or async")
        self.sim = Simulator(
            stage,
            make_worker=make_worker,
            seed=int(args.get("seed", "0")),
            faults=self._faults(Faults(), args),
            serial_shell=shell == "serial",
        )
        self.sim.load_errors = _load_errors(args)
        self.start_deadline_s = parse_duration_s(args.get("start-deadline", "10s"))
        self.sim.say(
            f"stage {stage.name!r}: {len(stage.ranks)} rank(s), tags {fmt_tags(stage.tags)}, policy "
            f"{stage.policy.value}, queue_limit {stage.queue_limit}, max_in_flight {stage.max_in_flight}, "
            f"{shell} rank shells"
        )
        self._start(lambda hello: self.s.start(self.start_deadline_s, hello=hello), args.get("hello", "deliver"))

    def _start(self, start: Callable[[bool], StageStep], hello: str) -> None:
        if hello not in ("deliver", "hold", "none"):
            raise ScriptError(f"hello={hello}: deliver, hold or none")
        start(hello != "none")
        if hello == "deliver":
            for envelope in self.s.find(kind="Hello", deliverable=True):
                if envelope.epoch == self.s.stage.epoch:
                    self.s.deliver(envelope)

    def cmd_faults(self, args: dict[str, str], bare: list[str]) -> None:
        self._only(args, set(_FAULT_KEYS))
        self.s.faults = self._faults(self.s.faults, args)
        f = self.s.faults
        self.s.say(
            f"faults: loss {f.loss:g}, duplicate {f.duplicate:g}, delay {f.delay:g} (up to "
            f"{fmt_s(f.max_delay_s)}), reorder {'on' if f.reorder else 'off'}, crash {f.crash:g}, "
            f"effect error {f.effect_error:g}"
        )

    @staticmethod
    def _faults(base: Faults, args: dict[str, str]) -> Faults:
        changes: dict[str, Any] = {}
        for key, field in _FAULT_KEYS.items():
            if key in args:
                changes[field] = (
                    _bool(args[key])
                    if field == "reorder"
                    else parse_duration_s(args[key])
                    if field == "max_delay_s"
                    else float(args[key])
                )
        return dataclasses.replace(base, **changes)

    @staticmethod
    def _only(args: dict[str, str], known: set[str]) -> None:
        unknown = sorted(set(args) - known)
        if unknown:
            raise ScriptError(f"unknown argument(s) {unknown}; known: {sorted(known)}")

    # ---------------------------------------------------------------- engine inputs

    def cmd_sleep(self, args: dict[str, str], bare: list[str]) -> None:
        self._only(args, {"task", "level", "tags", "deadline", "abort"})
        self.s.call(
            I.SleepCall(
                args["task"],
                int(args.get("level", "1")),
                _tag_list(args.get("tags", "all")),
                parse_duration_s(args.get("deadline", "30s")),
                abort_in_flight=_bool(args.get("abort", "no")),
            )
        )

    def cmd_wake(self, args: dict[str, str], bare: list[str]) -> None:
        self._only(args, {"task", "tags", "deadline", "wait"})
        self.s.call(
            I.WakeCall(
                args["task"],
                _tag_list(args.get("tags", "all")),
                parse_duration_s(args.get("deadline", "30s")),
                parse_duration_s(args.get("wait", "0s")),
            )
        )

    def cmd_reload(self, args: dict[str, str], bare: list[str]) -> None:
        self._only(args, {"task", "source", "deadline"})
        self.s.call(I.ReloadCall(args["task"], args.get("source"), parse_duration_s(args.get("deadline", "30s"))))

    def cmd_update(self, args: dict[str, str], bare: list[str]) -> None:
        self._only(args, {"task", "version", "source", "deadline"})
        self.s.call(
            I.UpdateCall(
                args["task"],
                int(args["version"]),
                _weight_source(args.get("source", "/ckpt")),
                parse_duration_s(args.get("deadline", "30s")),
            )
        )

    def cmd_weight_group(self, args: dict[str, str], bare: list[str]) -> None:
        self._only(args, {"task", "port", "world", "offset", "deadline"})
        self.s.call(
            I.WeightGroupCall(
                args["task"],
                "rl",
                "127.0.0.1",
                int(args.get("port", "29500")),
                int(args.get("world", "3")),
                int(args.get("offset", "1")),
                "gloo",
                parse_duration_s(args.get("deadline", "30s")),
            )
        )

    def cmd_share(self, args: dict[str, str], bare: list[str]) -> None:
        self._only(args, {"task", "bucket-bytes", "deadline"})
        self.s.call(
            I.ShareCall(
                args["task"], int(args.get("bucket-bytes", "1024")), parse_duration_s(args.get("deadline", "30s"))
            )
        )

    def cmd_pause(self, args: dict[str, str], bare: list[str]) -> None:
        self._only(args, {"task", "mode", "deadline"})
        self.s.call(I.PauseCall(args["task"], args.get("mode", "wait"), parse_duration_s(args.get("deadline", "30s"))))

    def cmd_resume(self, args: dict[str, str], bare: list[str]) -> None:
        self._only(args, {"task", "deadline"})
        self.s.call(I.ResumeCall(args["task"], parse_duration_s(args.get("deadline", "30s"))))

    def cmd_profile(self, args: dict[str, str], bare: list[str]) -> None:
        self._only(args, {"task", "start", "prefix", "deadline"})
        self.s.call(
            I.ProfileCall(
                args["task"],
                _bool(args.get("start", "yes")),
                args.get("prefix"),
                parse_duration_s(args.get("deadline", "30s")),
            )
        )

    def cmd_command(self, args: dict[str, str], bare: list[str]) -> None:
        kinds = {kind.__name__: kind for kind in STATELESS}
        if len(bare) != 1 or bare[0] not in kinds:
            raise ScriptError(f"command TYPE task= [deadline= FIELD=VALUE...]: TYPE is one of {sorted(kinds)}")
        fields: dict[str, Any] = {k: v for k, v in args.items() if k not in ("task", "deadline")}
        info = msgspec.inspect.type_info(kinds[bare[0]])
        for field in getattr(info, "fields", ()):  # a tuple's items, comma-separated: target_modules=q,v
            if field.name in fields and isinstance(field.type, msgspec.inspect.VarTupleType):
                fields[field.name] = [v for v in fields[field.name].split(",") if v]
            elif field.name in fields and fields[field.name][:1] in ("{", "["):  # a struct as JSON, no spaces
                fields[field.name] = json.loads(fields[field.name])
        raw = {"type": bare[0], "task_id": args["task"], "epoch": 0, **fields}
        try:
            command = msgspec.convert(raw, kinds[bare[0]], strict=False)  # "yes", "4096" read as their fields
        except msgspec.ValidationError as exc:
            raise ScriptError(f"command {bare[0]}: {exc}") from None
        self.s.call(I.CommandCall(command, parse_duration_s(args.get("deadline", "30s"))))

    def cmd_submit(self, args: dict[str, str], bare: list[str]) -> None:
        self._only(args, {"req", "payload", "timeout", "adapter"})
        payload, timeout_s = _value(args.get("payload", "0")), parse_duration_s(args.get("timeout", "30s"))
        self.s.call(I.Submit(args["req"], payload, timeout_s, args.get("adapter")))

    def cmd_set_admission(self, args: dict[str, str], bare: list[str]) -> None:
        if len(bare) != 1:
            raise ScriptError("set-admission queue|reject|wake")
        self.s.call(I.SetAdmission(AdmissionPolicy(bare[0])))

    def cmd_restart(self, args: dict[str, str], bare: list[str]) -> None:
        self._only(args, {"hello", "deadline", "load-error", "from-checkpoint"})
        deadline_s = parse_duration_s(args.get("deadline", fmt_s(self.start_deadline_s)))
        self.s.load_errors = _load_errors(args)
        reset = _bool(args.get("from-checkpoint", "no"))
        self._start(
            lambda hello: self.s.restart(deadline_s, hello=hello, from_checkpoint=reset), args.get("hello", "deliver")
        )

    def cmd_stop(self, args: dict[str, str], bare: list[str]) -> None:
        self.s.stop()

    def cmd_tick(self, args: dict[str, str], bare: list[str]) -> None:
        self.s.advance(parse_duration_s(bare[0]) if bare else 0.0)

    # ---------------------------------------------------------------- the network

    def _select(self, args: dict[str, str], *, deliverable: bool = False) -> list[Envelope]:
        self._only(args, {"id", "from", "to", "rank", "type", "task", "n", "by"})
        found = self.s.find(
            id=int(args["id"]) if "id" in args else None,
            sender=_address(args["from"]) if "from" in args else "any",
            to=_address(args["to"]) if "to" in args else "any",
            rank=_rank(args["rank"]) if "rank" in args else None,
            kind=args.get("type"),
            task_id=args.get("task"),
            deliverable=deliverable,
        )
        if not found:
            raise SimulationError(f"no message in flight matches {args}")
        count = args.get("n", "1")
        return found if count == "all" else found[: int(count)]

    def cmd_deliver(self, args: dict[str, str], bare: list[str]) -> None:
        for envelope in self._select(args, deliverable=True):
            if envelope in self.s.network:  # an earlier delivery may not have consumed it
                self.s.deliver(envelope)

    def cmd_deliver_all(self, args: dict[str, str], bare: list[str]) -> None:
        if not self.s.deliver_all():
            self.s.say("nothing may arrive now")

    def cmd_settle(self, args: dict[str, str], bare: list[str]) -> None:
        if not self.s.settle():
            self.s.say("nothing to do")

    def cmd_drop(self, args: dict[str, str], bare: list[str]) -> None:
        for envelope in self._select(args):
            self.s.drop(envelope)

    def cmd_dup(self, args: dict[str, str], bare: list[str]) -> None:
        for envelope in self._select(args):
            self.s.duplicate(envelope)

    def cmd_delay(self, args: dict[str, str], bare: list[str]) -> None:
        if "by" not in args:
            raise ScriptError("delay needs by=DURATION")
        for envelope in self._select(args):
            self.s.delay(envelope, parse_duration_s(args["by"]))

    def cmd_corrupt(self, args: dict[str, str], bare: list[str]) -> None:
        for envelope in self._select(args):
            self.s.corrupt(envelope)

    # ---------------------------------------------------------------- the ranks

    def cmd_done(self, args: dict[str, str], bare: list[str]) -> None:
        self._only(args, {"rank", "output"})
        ranks = [_rank(args["rank"])] if "rank" in args else self.s.busy_ranks()
        if not ranks:
            raise SimulationError("no rank is performing an effect")
        for rank in ranks:
            self.s.perform(rank, output=_value(args["output"]) if "output" in args else ECHO)

    def cmd_error(self, args: dict[str, str], bare: list[str]) -> None:
        self._only(args, {"rank", "msg"})
        self.s.perform(_rank(args["rank"]), error=args.get("msg", "CUDA error: an illegal memory access"))

    def cmd_refuse(self, args: dict[str, str], bare: list[str]) -> None:
        self._only(args, {"rank", "msg"})
        self.s.perform(_rank(args["rank"]), refuse=args.get("msg", "no checkpoint at that source"))

    def cmd_crash(self, args: dict[str, str], bare: list[str]) -> None:
        self._only(args, {"rank", "detail"})
        self.s.crash(_rank(args["rank"]), args.get("detail", "SIGKILL"))

    def cmd_block(self, args: dict[str, str], bare: list[str]) -> None:
        rank = _rank(args["rank"])
        self.s.blocked.add(rank)
        self.s.say(f"block r{rank}: the engine's send queue to r{rank} is full")

    def cmd_unblock(self, args: dict[str, str], bare: list[str]) -> None:
        rank = _rank(args["rank"])
        self.s.blocked.discard(rank)
        self.s.say(f"unblock r{rank}")

    def cmd_status(self, args: dict[str, str], bare: list[str]) -> list[str]:
        return self.s.status_lines()


_FAULT_KEYS = {
    "loss": "loss",
    "dup": "duplicate",
    "delay": "delay",
    "max-delay": "max_delay_s",
    "reorder": "reorder",
    "crash": "crash",
    "effect-error": "effect_error",
}

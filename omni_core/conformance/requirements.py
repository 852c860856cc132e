"""The requirements of `specs/protocol.md`, as the suite quotes them on failure.

The text is a verbatim copy of the normative paragraphs, so the suite quotes them without
parsing Markdown at run time (the wheel also carries specs/protocol.md: omni_core.resources);
`tests/conformance/test_requirements.py` fails when the two drift apart.
`worker` says whether a worker can be checked against the requirement at all: P-5 and P-9
bind the orchestrator (a stage), so the suite lists them as not applicable.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Requirement:
    id: str
    title: str
    text: str
    worker: bool = True  # False: a stage/orchestrator requirement, nothing to check on a worker
    why_not: str = ""


REQUIREMENTS: dict[str, Requirement] = {
    r.id: r
    for r in (
        Requirement(
            "P-1",
            "One terminal reply",
            "For every command a worker receives, it MUST send exactly one terminal reply (`Ack`, "
            "`Nack` or `Result`) per (task_id, rank). A copy of a command that arrives while its "
            "task is still in progress MUST NOT produce a reply of its own; the one terminal reply "
            "follows when the task completes. A refusal (`Nack` without effect) is not recorded, so"
            " a copy of a refused command is judged afresh and MAY be refused again; it MUST NOT be"
            " refused and later take effect under the same task_id from the same state.",
        ),
        Requirement(
            "P-2",
            "Idempotent duplicates",
            "A command whose `task_id` the worker has already answered MUST be answered with "
            "the same reply from a bounded reply cache, and MUST NOT take effect a second time. "
            "A different command under an already-used `task_id` MUST be refused with "
            "`Nack TASK_ID_REUSED`. The cache MUST be bounded in entries and in bytes (default 1024 "
            "entries and 16 MiB, least recently used evicted), MUST hold at least the 64 latest answers "
            "whatever it is configured to, MUST NOT be changed by `Status`, and MUST keep a digest of each "
            "command, not the command; a reply too large to keep is answered on a copy with `Nack REPLY_NOT_KEPT` and "
            "no effect. Callers retry within that window.",
        ),
        Requirement(
            "P-3",
            "Envelope",
            "Every message MUST carry the protocol version `v`, a caller-supplied non-empty "
            "`task_id` (at most 128 characters) and the stage `epoch` (an integer >= 0); every "
            "reply MUST carry the `rank` that sent it. A peer MUST refuse any other protocol "
            "version with `Nack UNSUPPORTED_VERSION` whose detail names both versions.",
        ),
        Requirement(
            "P-4",
            "ALREADY no-ops",
            "A `Sleep` whose tags are all asleep and a `Wake` whose tags are all resident MUST be "
            "answered with `Ack status=ALREADY`, MUST have no effect, and MUST NOT crash or fail "
            "the worker or the stage. A second `Shutdown` MUST be answered with `Ack "
            "status=ALREADY` while the worker still runs; a worker that has already exited after "
            "the first MUST have exited cleanly (status 0).",
        ),
        Requirement(
            "P-5",
            "All-ranks commit",
            "A stage MUST commit `SLEEPING`, `RUNNING`, `PARTIAL` or `NEEDS_RELOAD` (or `PAUSED` "
            "after a weight update) only when every rank has ACKed the current task, in the "
            "current epoch, with the state and asleep tags the stage expects. Until then it "
            "stays `TRANSITIONING`/`WAKING`.",
            worker=False,
            why_not="a stage (orchestrator) requirement; a worker has no part of it to check",
        ),
        Requirement(
            "P-6",
            "Fencing",
            "A reply from an older epoch, for a task other than the current one, or a second "
            "reply from a rank that already answered MUST NOT change the stage's state; it MUST "
            "be ignored and counted. A worker MUST refuse a command from an epoch older than the "
            "newest it has seen with `Nack STALE_EPOCH`, and adopt a newer epoch.",
        ),
        Requirement(
            "P-7",
            "Execution only when resident",
            "A worker MUST execute a request only in `ACTIVE`: every tag resident and the weights "
            "valid. In every other state `Execute` MUST be refused: with `Nack INVALID_STATE` "
            "naming the state, or `Nack BUSY` while another task is in progress, or `Nack FAILED` "
            "in `FAILED`. A stage MUST admit a request only while `RUNNING`; while not, requests "
            "are queued (bounded), rejected with a clear error, or trigger a wake, per the stage's "
            "admission policy, and none is lost. A pause (`PAUSED`: admission closed by the "
            "orchestrator, nothing released, nothing sent to the ranks to enter or leave it but under "
            "mode `keep`, P-23) is not `RUNNING`: no request starts there, and none is in flight but "
            "those a pause of mode `keep` holds on the ranks (P-23).",
        ),
        Requirement(
            "P-8",
            "Level-2 reload rule",
            "After a level-2 sleep, nothing MUST execute on that worker until `ReloadWeights` "
            "has completed: a wake after level 2 ends in `NEEDS_RELOAD` (memory mapped, weights "
            "invalid), never `ACTIVE`.",
        ),
        Requirement(
            "P-9",
            "Deadlines",
            "Every stage command MUST have a deadline. A rank that has not replied by then, a "
            "`Nack`, or a rank process that dies MUST end the task with the stage `FAILED`, and "
            "the error MUST name the ranks and the reasons. No call waits without bound. A "
            "`FAILED` stage leaves `FAILED` only by a restart, which starts fresh ranks under a "
            "new epoch.",
            worker=False,
            why_not="a stage (orchestrator) requirement; the suite itself puts a deadline on every receive",
        ),
        Requirement(
            "P-10",
            "Bad bytes",
            "Bytes that do not decode to a valid message of this version MUST be answered with "
            "`Nack BAD_MESSAGE` (with the `task_id` when it could be read, `-` otherwise) whose "
            "detail says what was wrong, and the worker MUST go on serving.",
        ),
        Requirement(
            "P-11",
            "No half-applied commands",
            "A command that the current state does not allow MUST be answered with "
            "`Nack INVALID_STATE` whose detail names the state, and MUST have no effect. A "
            "worker that is busy with another task answers `Nack BUSY`. A command that fails in "
            "the memory backend moves the worker to `FAILED`; from then on every reply's detail "
            "carries the failure and only `Shutdown` (or a restart) leaves `FAILED`. `Status` MUST change "
            "nothing. `Shutdown` MUST be acknowledged with `Ack state=STOPPED` in every state that is not "
            "transient (`ACTIVE`, `SLEEPING`, `PARTIAL`, `NEEDS_RELOAD`, `FAILED`), after which the process "
            "MUST exit with status 0.",
        ),
        Requirement(
            "P-12",
            "Per-process memory reports",
            "Every `Ack` of `Sleep`, `Wake`, `ReloadWeights` and `Status` MUST carry a memory "
            "report: the backend pool bytes per tag before and after, and this process's GPU "
            "bytes before and after with the source of that figure (`nvml`, or the fallback "
            "used and why). Device-wide deltas MUST NOT be reported as the process's. A `Hello` "
            "MAY carry `pool_bytes`; one that does MUST give the bytes each of its tags holds as "
            "loaded, those the first `Sleep` finds (its `pool_bytes_before`).",
        ),
        Requirement(
            "P-13",
            "Bounded, refusable input",
            "A worker MUST refuse a frame over its frame limit (default 64 MiB) with `Nack BAD_MESSAGE`, "
            "before it answers any later command, without reading it into memory, and MUST refuse a command "
            "whose epoch is more than 64 ahead of its own with `Nack EPOCH_AHEAD`, its epoch unchanged. "
            "A command whose arguments the runner cannot use (an unusable reload source) MUST be refused "
            "with `Nack INVALID_ARGUMENT` before anything is written, leaving the worker in the state it "
            "was in; only a failure of the memory operations themselves moves a worker to `FAILED`.",
        ),
        Requirement(
            "P-14",
            "Authenticated ranks",
            "A worker started with a rank secret (environment `OMNI_CORE_RANK_SECRET`, hex) MUST prove its "
            "`Hello`: `proof` is the HMAC-SHA256 of `omni_core.protocol.auth.hello_proof` over its stage, "
            "rank, epoch, pid and socket identity. An orchestrator MUST bind a socket identity to a rank "
            "only on a valid proof from the process it started, MUST NOT rebind a bound rank or identity, "
            "MUST take a reply's rank from the identity it arrived on and drop (and count) one whose body "
            "names another rank, and MUST NOT commit on an `Ack` of an effect (`status=OK`) that carries "
            "no memory report.",
        ),
        Requirement(
            "P-15",
            "Profiling never changes the lifecycle",
            "`Profile(start=true)` starts the worker's profiler, `Profile(start=false)` stops it and "
            "writes its trace. A worker that declares the capability `profile` MUST accept `Profile` "
            "exactly where its transition table has `profile`/`profile_already`: `ACTIVE`, `SLEEPING`, "
            "`PARTIAL` and `NEEDS_RELOAD`, the states in which no lifecycle effect runs (a profile is "
            "meant to span sleeps and wakes, which is what it measures). Anywhere else it MUST refuse it "
            "like any command: `Nack BUSY` while an effect runs (`OFFLOADING`, `RESTORING`, `RELOADING`), "
            "`Nack FAILED` in `FAILED` (restart the stage), `Nack INVALID_STATE` in `LOADING` and "
            "`STOPPED`. An answer to `Profile` MUST carry the state the worker was in when it arrived: "
            "neither the command nor its effect changes the state or the residency. A start while a "
            "profile runs and a stop while none runs MUST be answered `Ack status=ALREADY` with no effect "
            "(the running profile keeps its prefix; the stop's `trace_paths` is empty). A start's "
            "`prefix` becomes part of a file name: a worker MUST refuse one that is empty, longer than 64 "
            "characters, has a character outside `[A-Za-z0-9_.-]` or contains `..` with `Nack "
            "INVALID_ARGUMENT` naming the problem, before starting anything. A stop's `Ack` MUST list in "
            "`trace_paths` the absolute paths of the traces it wrote, named "
            "`{stage}-rank{r}-{prefix}-{time}.json.gz` (`{stage}-rank{r}-{time}.json.gz` without a "
            "prefix; `time` UTC to the microsecond, strictly increasing per rank), so stages, ranks and "
            "stops never overwrite each other; a listed path MUST appear only once complete (written "
            "under another name and renamed), and MAY appear after the `Ack`. A failure of the profiler "
            "MUST be answered `Nack PROFILE_ERROR`, with no profile running afterwards and the state "
            "unchanged; it never moves a worker to `FAILED`. At most one profile runs per rank, and a "
            "worker MUST bound it (omni-core: a profile running past `profile_max_s`, default 600 s, is "
            "stopped and written, and the next stop lists it). `Profile` is idempotent by `task_id` and "
            "fenced by epoch like every command (P-2, P-6). A stage sends `Profile` to every rank only in "
            "a settled state with no task in flight, keeps admitting requests meanwhile, and never "
            "changes state on the answers: a rank's `Nack` that leaves it where the stage committed it "
            "(`BUSY`, `PROFILE_ERROR`, `INVALID_ARGUMENT`, `BAD_MESSAGE` from a worker that predates "
            "`Profile`) is that rank's refusal in the outcome; an answer in another state, or none by the "
            "deadline, fails the stage naming the rank (P-9).",
        ),
        Requirement(
            "P-16",
            "A wake never allocates past the device",
            "A worker that declares the capability `swap` MUST, before it maps (or moves to the device) each "
            "allocation of a `Wake`, check that the device's free memory covers it, and MUST NOT map an "
            "allocation that it does not cover (a driver out-of-memory on an allocation that was covered counts "
            'as "not free yet"; a device with no capacity to run out of, such as a CPU, has nothing to check). '
            "`Wake.memory_wait_s` (seconds, 0 to 3600, default 0) bounds how long the worker MAY wait for "
            "memory that another process is releasing, counted from the start of the wake; with 0 it MUST NOT "
            "wait, and it MUST NOT refuse for lack of memory before that time has passed. When the memory is "
            "not free in time the worker MUST roll the wake back: unmap every allocation this wake mapped, keep "
            "the host copies valid (nothing is invalidated, so a later `Wake` restores the same bytes), return "
            "to the state the `Wake` found (`SLEEPING`, `PARTIAL` or `NEEDS_RELOAD`) with the same tags asleep, "
            "and answer `Nack NO_MEMORY` whose detail names the bytes needed, the bytes free and who holds the "
            "device memory (each process the driver lists on the device with its pid and bytes; on omni-core's "
            "simulated device each holder's stage, rank, pid and bytes). The refusal MUST be kept in the reply "
            "cache like any answer (P-2): a copy of the `Wake` gets it again and has no effect, the same "
            "`task_id` with another `memory_wait_s` is another command (`Nack TASK_ID_REUSED`), and a `Wake` "
            "under a new `task_id` is judged afresh. A worker that does not declare `swap` MUST refuse a `Wake` "
            "with `memory_wait_s > 0` with `Nack UNSUPPORTED` and no effect (one that predates the field "
            "refuses it as an unknown field, `Nack BAD_MESSAGE`, P-10), and an orchestrator MUST send "
            "`memory_wait_s > 0` only to a stage whose ranks all declared `swap`. A stage whose ranks all "
            "refuse `NO_MEMORY` (a wake that could wait or one with `memory_wait_s` 0 alike: either rolled "
            "back) returns to the state the wake started from, at its weights version, and reports the refusal "
            "naming each rank and its detail; a rank that could not roll back raises and fails instead; when "
            "some ranks woke and others refused, the stage MUST end `FAILED` naming both (its ranks now hold "
            "different tags). A swap (omni-core: `Engine.swap(out, in)`) sends the outgoing stage's `Sleep` and "
            "the incoming stage's waiting `Wake` together, under the task ids `{id}/out` and `{id}/in`, so that "
            "a repeated swap is answered from both stages' records; it completes only when both halves do, and "
            "otherwise reports each stage's exact state and, on `NO_MEMORY`, who holds the memory. The "
            "orchestrator admits one incoming wake per device at a time: a swap whose incoming stage runs on a "
            "device (a GPU of any of its ranks) where another swap's waiting `Wake` is in flight is sent once "
            "that `Wake` has ended, within its own deadline, or refused with nothing sent (two incoming stages "
            "that each keep what they mapped while they wait could otherwise both be refused: "
            "`tla/OmniSwap.tla`, `NotBothRefused`).",
        ),
        Requirement(
            "P-17",
            "Versioned weight updates",
            "`UpdateWeights(version, source)` replaces a rank's weights in place. `version` is an integer chosen "
            "by the caller (1 to 2^63-1); `source` is one of `disk` (a safetensors directory, read as "
            "`ReloadWeights` reads it), `shm` (buckets of host shared memory a sender process filled), `ipc` (the "
            "same buckets in the sender's device memory, each described by a `CudaIpcHandle` of typed fields: "
            "device, handle bytes, storage offset and size, offset and size in the storage, ref counter, event; "
            "never a pickle) or `collective` (tensors that root 0 of the group set up by `InitWeightGroup` "
            "broadcasts, in the order listed). Everything is bounded and checked on decode, else `Nack "
            "BAD_MESSAGE` (P-10): at most 4096 buckets and 16384 tensors per update, names of 1-256 characters, "
            "each at most once per update, at most 8 dimensions, a dtype from the schema's list, every tensor "
            "inside its bucket (`offset_bytes + nbytes <= bucket nbytes`), a CUDA IPC bucket inside its storage "
            "and its storage at most 1 TiB. An `ipc` bucket that carries the old `handle` (a pickle) is refused "
            "naming `ipc`. Each bucket names its `sender_pid`, the process that made it and keeps it alive.",
        ),
        Requirement(
            "P-18",
            "A link plan moves the same bytes over more links",
            "A `Sleep` or `Wake` MAY carry `links`, a link plan of at most 8 paths, each `{peer, share}`: `peer` "
            "null is the rank's own host link, an integer is the CUDA device index (as the rank sees it) of a "
            "peer GPU whose host link carries `share` of the bytes (a positive relative weight), relayed to or "
            "from the rank's device over NVLink/P2P through staging buffers on the peer. An orchestrator MUST "
            "send `links` only to a rank whose `Hello` declared the capability `multi_path` and listed the peer "
            "in `Hello.relay_peers`, MUST lend a GPU's link to one command at a time, and MUST NOT lend the GPU "
            "of a stage that has a lifecycle command in flight or of the commanding stage itself; it plans each "
            "task once, so a resent command carries the same plan. A worker that does not declare `multi_path` "
            "MUST refuse a command with `links` with `Nack UNSUPPORTED` and no effect. A worker that declares it "
            "MUST leave exactly the state, tags and bytes the same command without `links` would (P-4, P-12), and "
            "MUST treat a relay that fails (no room for staging on the peer, a refused copy, a peer that errs) as "
            "a reason to finish on its own link: a sleep releases an allocation only once its bytes have landed "
            "on the host; a wake rolls back what it mapped (as P-16's refusal does, host copies kept) and runs "
            "again on its own link. Staging memory on a peer is held only while the command runs. The plan is "
            "left off the wire when empty, so a command without one is the frame every version-1 worker knows. "
            "omni-core's planner: `omni_core/engine/link_plan.py`; its relays: "
            "`omni_core/workers/backends/lanes.py`.",
        ),
        Requirement(
            "P-19",
            "Dropping the runner's caches never moves memory",
            "`ResetPrefixCache` asks the worker's runner to drop what it caches across requests (prefix KV "
            "blocks, prompt embeddings), so that later requests compute afresh (after a weight update, say). "
            "A worker MUST accept it exactly where its transition table has `reset_prefix_cache`: `ACTIVE` and "
            "`PARTIAL`, where the weights and caches it would drop are resident; anywhere else it MUST refuse "
            "it like any command (`Nack BUSY` while an effect runs, `Nack FAILED` in `FAILED`, `Nack "
            "INVALID_STATE` elsewhere). It MUST NOT release, map or move any pool memory: its `Ack` carries "
            "the state and the asleep tags the command found and a memory report whose pool bytes before "
            "and after are equal (a runner that caches nothing across requests has nothing to drop and "
            "answers the same). A failure of the runner MUST be answered `Nack EXECUTE_ERROR` with the state "
            "unchanged; it never moves a worker to `FAILED`. It is idempotent by `task_id` and fenced by "
            "epoch like every command (P-2, P-6). A stage sends it to every rank only in `RUNNING`, `PAUSED` "
            "or `PARTIAL` with no task in flight, never changes state on the answers, and reports a rank's "
            "`Nack` that leaves it where the stage committed it as that rank's refusal (as for `Profile`, "
            "P-15).",
        ),
        Requirement(
            "P-20",
            "An adapter is served only loaded, on the weights it was made for",
            "A worker that declares the capability `adapters` holds LoRA adapters, each named, with an integer "
            "`adapter_id`, a `rank`, its `target_modules`, its own `version` and the `base_version` of the "
            "weights it was made for; a worker that does not MUST refuse the four commands below with `Nack "
            "UNSUPPORTED` and no effect. They never change the lifecycle state, are idempotent by `task_id` and "
            "fenced by epoch like every command (P-2, P-6), and refused while an effect runs (`Nack BUSY`) or in "
            "`FAILED` (`Nack FAILED`).",
        ),
        Requirement(
            "P-21",
            "A save writes the version held, whole or not at all",
            "A worker that declares the capability `save_weights` answers `SaveWeights(directory, ranks, "
            "max_file_bytes, overwrite)` by writing the weights it holds, at its weights version, to its own "
            "disk: `directory` itself when `ranks` is 1, else `directory/rank-<r>` for rank `r`. A worker that "
            "does not declare it MUST refuse it with `Nack UNSUPPORTED` and no effect. A worker MUST accept it "
            "exactly where its transition table has `save_weights` with valid weights awake: `ACTIVE`, or "
            "`PARTIAL` with `weights` awake; anywhere else it MUST refuse it like any command (`Nack BUSY` "
            "while an effect runs, `Nack FAILED` in `FAILED`, `Nack INVALID_STATE` elsewhere). It MUST NOT "
            "change the lifecycle state, the weights, their version or any pool. It MUST write into a directory "
            "beside the target and rename it into place only once every file is written, so that a save that "
            "fails leaves nothing under the target's name; it MUST refuse with `Nack INVALID_ARGUMENT`, writing "
            "nothing there, a target that exists (unless `overwrite`), a path that is not absolute or goes "
            "through a symbolic link, and a `ranks` its rank is not below; any other failure of the write is "
            "`Nack INVALID_ARGUMENT` naming it, the rank still serving. What it writes MUST hold an index "
            "(`omni_weights.json`) naming the weights version, and MUST be what its `ReloadWeights` reads back "
            "bit for bit, acknowledged at the version the index names. It is idempotent by `task_id` and "
            "fenced by epoch like every command (P-2, P-6). A "
            "stage sends it to every rank only in `RUNNING`, `PAUSED` or `PARTIAL` with valid weights awake, "
            "never changes state on the answers, and once every rank acknowledged it records `directory` as "
            "where its version lives, so that a restart reloads it at that version (P-17); a `ReloadWeights` of "
            "it commits the version every rank acknowledged, the same on every rank and not below a version "
            "floor, else the stage fails.",
        ),
        Requirement(
            "P-22",
            "A transfer between stages is versioned, bounded and released",
            "A worker that declares the capability `transfer` moves one request's tensors (hidden states, prompt "
            "embeddings, KV blocks) to another stage's ranks over the planes of P-17 (host shared memory, CUDA "
            "IPC on one node); a worker that does not MUST refuse the three commands below with `Nack "
            "UNSUPPORTED` and no effect. They never change the lifecycle state, are idempotent by `task_id` and "
            "fenced by epoch like every command (P-2, P-6), refused while an effect runs (`Nack BUSY`) or in "
            "`FAILED` (`Nack FAILED`), and a refusal of their arguments is `Nack INVALID_ARGUMENT` with nothing "
            "held. `TransferOut(request_id, names, payload, max_bytes, bucket_bytes)` MUST be accepted only in "
            "`ACTIVE`: the runner computes `names` for `payload` (names and shapes its connector declares; "
            "otherwise refused), their bytes MUST NOT exceed `max_bytes`, and the worker holds them in buckets "
            "for `request_id` until a `TransferRelease` of it or `Shutdown`, listed in the `Ack`'s `shared`, with"
            " the worker's `weights_version`. `TransferIn(request_id, producer_version, source, expect_version, "
            "max_bytes)` MUST be accepted only in `ACTIVE`; a `source` over `max_bytes` is refused on decode "
            "(P-10); a worker MUST refuse, keeping nothing, an `expect_version` other than `producer_version`, "
            "and a name, shape or dtype its connector does not import, before it opens a handle, and MUST open "
            "every handle as P-17 opens an update's; it keeps a copy for the request, which a later `Execute` "
            'names (`"transfer"` in its payload); that `Execute` takes it: the worker MUST drop the copy when the '
            "request ends, before its `Result` or `Nack`, whether its runner used it or not. "
            "`TransferRelease(request_id)` MUST be accepted in `ACTIVE`, "
            "`SLEEPING`, `PARTIAL` and `NEEDS_RELOAD` and drops whatever the worker holds for the request "
            "(nothing held: the same `Ack`). A stage sends `TransferOut` and `TransferIn` only in `RUNNING` and "
            "`TransferRelease` in any settled state; a producer stage MUST NOT sleep or take an update while a "
            "transfer it exported is held (until its release is answered), and a consumer stage MUST NOT be sent "
            "a transfer for a request declared for another producer version. An orchestrator admits a transfer at"
            " its consumer by the consumer's admission policy (P-7): `RUNNING` lands it, a sleeping consumer "
            "queues it or is woken for it, a `PAUSED` one queues it; it answers the request exactly once and "
            "releases the producer's buckets at every end, a consumer that died included "
            "(`tla/OmniTransfers.tla`).",
        ),
        Requirement(
            "P-23",
            "A held request resumes on the weights it records",
            '`HoldRequests(hold, clear_cache)` is pause mode `keep` (vLLM\'s `pause_generation(mode="keep")`, '
            "SGLang's `in_place`). A worker MUST accept it only in `ACTIVE`; anywhere else it MUST refuse it like"
            " any command (`Nack BUSY` while an effect runs, `Nack FAILED` in `FAILED`, `Nack INVALID_STATE` "
            "naming the state elsewhere). Neither the command nor its effect changes the lifecycle state, the "
            "residency or the weights version: its `Ack` carries the state `ACTIVE`, no tag asleep and the rank's"
            " `weights_version`. `hold=true` freezes the requests running on the rank where they are: a runner "
            "that can stop between its steps keeps each one's state and KV (with `clear_cache` it drops their KV "
            "instead, and each restarts generation from its prompt at the release); a worker whose runner cannot "
            "MUST answer every running request before the hold's `Ack` (mode `wait`); with none running it is "
            "acknowledged at once, holding nothing, and the rank counts as held until the release. While requests"
            " are held the worker MUST NOT step them and MUST refuse every command but `Status`, `UpdateWeights` "
            "and `HoldRequests` with `Nack BUSY` naming the held requests; an `UpdateWeights` (P-17) MAY run "
            "beside them. `hold=false` releases them: its `Ack` comes first, then each goes on under the weights "
            "version held then and is answered once, after that `Ack`: none is answered between the hold's `Ack` "
            "and the release's but by the failures below. The `Result` of a request held while the version "
            "changed MUST name the version it finished under in `weights_version` and list in `version_spans` "
            "which tokens each version computed (`{weights_version, start_token}`, in token order, the first at "
            "token 0, versions rising, the last under `weights_version`; at most 64: a request held through more "
            "updates fails `EXECUTE_ERROR` at its release); a request that `clear_cache` restarted lists no span "
            "for the tokens it dropped and names their count in `discarded_tokens`. An update that fails beside "
            "held requests (`UPDATE_FAILED`), or a hold whose runner raised (`Nack EXECUTE_ERROR`), fails each "
            "held request once with `Nack EXECUTE_ERROR` and ends the hold. A `hold=true` while held and a "
            "`hold=false` while not are `Ack status=ALREADY` with no effect. It is idempotent by `task_id` and "
            "fenced by epoch like every command (P-2, P-6). A stage sends `hold=true` to every rank when it "
            "pauses with mode `keep` while requests are in flight, commits `PAUSED` with them still in flight "
            "once every rank ACKed it in `ACTIVE` at the stage's version (any other answer fails the stage), "
            "takes no lifecycle call but an update while they are held (P-17 rule 7), and sends `hold=false` at "
            "the resume (`tla/OmniKeep.tla`).",
        ),
    )
}


def requirement(req_id: str) -> Requirement:
    try:
        return REQUIREMENTS[req_id]
    except KeyError:
        raise KeyError(f"unknown requirement {req_id!r}; known: {', '.join(REQUIREMENTS)}") from None

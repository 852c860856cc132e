------------------------------- MODULE OmniVersions -------------------------------
(***************************************************************************)
(* Versioned weight updates (P-17): one stage of ranks, each with the     *)
(* weights version resident on its device, the version its backend's      *)
(* clean host copy holds (or none), and its worker state. The stage        *)
(* updates every rank to a version above the committed one, from RUNNING *)
(* (draining a request in flight first), PAUSED, PARTIAL (the weights     *)
(* awake, kv_cache asleep) and NEEDS_RELOAD; each rank writes it and ACKs,*)
(* refuses it before writing, or fails once writing began (NEEDS_RELOAD   *)
(* at its old version), and ranks may answer apart (FAILED). The stage    *)
(* commits only on a complete ACK set; requests run only in RUNNING and   *)
(* record the versions of the ranks that served them. A level-1 sleep     *)
(* copies the weights to the host unless the clean copy is still valid; a *)
(* wake restores from that copy, of every tag or of the weights alone.    *)
(*                                                                         *)
(* Each rank keeps a cache derived from its weights (vLLM's prefix KV    *)
(* blocks): every entry carries the version it was computed under, and a  *)
(* request may reuse any entry its rank holds. A rank drops the cache     *)
(* when it writes an update, before it ACKs.                              *)
(*                                                                         *)
(* A restart (a new epoch) starts fresh ranks from the committed          *)
(* version's durable source: a version an update wrote from a directory   *)
(* comes back; one that came from memory cannot, and the stage comes back *)
(* NEEDS_RELOAD under a version floor, taking updates at or above it      *)
(* only. The caller may restart from the checkpoint instead: version 0,   *)
(* said out loud (the ghost `peak` resets with it).                       *)
(*                                                                         *)
(* A save (SaveWeights, P-21) writes the committed version to a directory *)
(* where the stage's weights are valid and awake (RUNNING, PAUSED, PARTIAL *)
(* with the weights awake) and no task is in flight: no rank's state,     *)
(* weights or version changes, and the committed version is durable from *)
(* then on (`saved`, the version the durable source holds, is it), so a   *)
(* restart comes back at it, even one that came from memory. A later      *)
(* update from memory makes the durable source stale again.               *)
(*                                                                         *)
(* A stage asleep at level 1 whose ranks declare host_refit takes an      *)
(* update into its ranks' host copies (a refit): nothing goes to the      *)
(* device, the ranks and the stage stay SLEEPING, and the next wake       *)
(* restores the new version; a rank that fails midway leaves no host copy *)
(* standing for any version, and the wake of such ranks lands            *)
(* NEEDS_RELOAD.                                                           *)
(*                                                                         *)
(* A paused stage may sleep and wake (PAUSED again after it, until        *)
(* resume); a rank may die (FAILED, the task abandoned) and the engine    *)
(* may stop the stage (STOPPED, every rank shut down) wherever a restart  *)
(* can follow.                                                             *)
(*                                                                         *)
(* What must hold: no request runs on mixed versions, after a wake every  *)
(* rank holds the last committed version (an update invalidates the clean *)
(* host copy, so the next sleep copies again), no request that ran at     *)
(* version v reused a cache entry of another version, and no request runs *)
(* below the highest version committed since the caller last reset it     *)
(* (versions never go backwards across epochs unless the caller asked),   *)
(* and a sleeping rank holds no weights on its device (so a refit never   *)
(* has the old and the new version there at once).                        *)
(*                                                                         *)
(* Every worker and stage step comes from VersionTable.tla, GENERATED     *)
(* from omni_core/fsm (omni_core.formal.gen_versions): firing a trigger   *)
(* the tables lack stops TLC, and the ASSUMEs below check what this spec  *)
(* relies on of the rows; SettleRows, the StageCore's own answer to every *)
(* combination of ranks' answers, must be what the spec's Rule says.      *)
(*                                                                         *)
(* Witness names one situation the code allows (an update from PARTIAL,   *)
(* ...); its models expect WitnessUnseen to be violated: TLC reaches it.  *)
(***************************************************************************)
EXTENDS Integers, FiniteSets, TLC, VersionTable

CONSTANTS
    Ranks,       \* the stage's ranks
    MaxVersion,  \* updates go to versions 1..MaxVersion
    RankFails,   \* a rank may refuse or fail an update
    MaxRestarts, \* restarts (epochs) explored
    Witness,     \* "none", or the situation a witness model must reach (Witnesses)
    Bug          \* "none" | "commit_early" | "stale_host_copy" | "no_flush" | "silent_revert" | "floor_ignored"
                 \* | "refit_old_host" | "refit_on_device" | "save_stale"

NONE == -1        \* no weights resident (asleep) / no valid host copy
Versions == 0..MaxVersion
Witnesses == {"none", "update_from_partial", "update_from_paused", "drain_before_update",
              "mixed_answers", "restart_after_update", "restart_needs_reload", "restart_reset",
              "refit_asleep", "refit_lost", "save_then_restart"}
ASSUME Witness \in Witnesses
Max(a, b) == IF a > b THEN a ELSE b

Has(rows, s, t) == \E row \in rows : row[1] = s /\ row[2] = t
Fire(rows, who, s, t) ==
    IF Has(rows, s, t) THEN (CHOOSE row \in rows : row[1] = s /\ row[2] = t)[3]
    ELSE Assert(FALSE, <<who, "fires a trigger its table forbids", s, t>>)
TW(s, t) == Fire(WorkerRows, "a rank", s, t)
TS(s, t) == Fire(StageRows, "the stage", s, t)
\* The actions fire rows through W and S; the reachability wrapper (omni_core/formal/
\* reachability.py) substitutes both, printing each row the first time it fires, so what the
\* spec assumes of the rows reads them through TW and TS, which it leaves alone.
W(s, t) == TW(s, t)
S(s, t) == TS(s, t)

\* What the spec relies on of the generated rows.
ASSUME \A row \in StageRows : row[2] = "execute" => row[1] = "RUNNING"         \* P-7
ASSUME \A row \in WorkerRows : row[2] = "execute" => row[1] = "ACTIVE"
ASSUME \A row \in StageRows \cup WorkerRows : row[2] = "update_failed" => row[3] = "NEEDS_RELOAD"
ASSUME \A s \in {"ACTIVE", "PARTIAL", "NEEDS_RELOAD"} : TW(TW(s, "update"), WorkerRefused[s]) = s
ASSUME \A s \in {"RUNNING", "PAUSED", "PARTIAL", "NEEDS_RELOAD"} : TS("WAKING", StageRefused[s]) = s
ASSUME TS("WAKING", UpdateSettle.stage) = "RUNNING" /\ TW(TW("ACTIVE", "update"), UpdateSettle.rank) = "ACTIVE"
ASSUME TS("WAKING", PartialSettle.stage) = "PARTIAL" /\ TW(TW("PARTIAL", "update"), PartialSettle.rank) = "PARTIAL"
ASSUME TS("STARTING", "started_needs_reload") = "NEEDS_RELOAD" /\ TW("LOADING", "loaded_needs_reload") = "NEEDS_RELOAD"
\* A refit leaves the ranks and the stage asleep, whatever the ranks answer (host_refit).
ASSUME TW(TW("SLEEPING", "update_asleep"), RefitSettle.rank) = "SLEEPING"
ASSUME TW(TW("SLEEPING", "update_asleep"), RefitSettle.rankFailed) = "SLEEPING"
ASSUME TW(TW("SLEEPING", "update_asleep"), WorkerRefused["SLEEPING"]) = "SLEEPING"
ASSUME TS("WAKING", RefitSettle.stage) = "SLEEPING" /\ TS("WAKING", RefitSettle.stageFailed) = "SLEEPING"
ASSUME TS(TS("SLEEPING", "wake"), LostWakeSettle.stage) = "NEEDS_RELOAD"
ASSUME TW(TW("SLEEPING", "wake"), LostWakeSettle.rank) = "NEEDS_RELOAD"
\* A save never changes a state (P-21), and it goes where the weights are valid and awake.
ASSUME \A row \in StageRows \cup WorkerRows : row[2] = "save_weights" => row[3] = row[1]
ASSUME {row[1] : row \in {r \in StageRows : r[2] = "save_weights"}} \subseteq {"RUNNING", "PAUSED", "PARTIAL"}
ASSUME {row[1] : row \in {r \in WorkerRows : r[2] = "save_weights"}} \subseteq {"ACTIVE", "PARTIAL"}

\* The trigger an update goes to a rank by: into its host copy while it sleeps.
Upd(s) == IF s = "SLEEPING" THEN "update_asleep" ELSE "update"

VARIABLES
    stage,       \* the stage's state
    committed,   \* the version the stage committed last (0 under a floor: the ranks hold the checkpoint)
    task,        \* the stage's update task is open (it has not settled)
    from,        \* the stage state the update started in
    target,      \* the version the update in flight writes
    disk,        \* the update in flight comes from a directory (else from memory)
    pending,     \* ranks the update has not reached yet
    answer,      \* rank -> "none" | "ack" | "refused" | "failed"
    wstate,      \* rank -> its worker state
    version,     \* rank -> the version resident on its device (NONE while asleep)
    host,        \* rank -> the version its clean host copy holds (NONE: none or invalid)
    mixed,       \* a ghost: a request ran on ranks holding different versions
    woke,        \* a ghost: the last lifecycle step was a wake
    cache,       \* rank -> the versions its derived-cache entries were computed under
    stale,       \* a ghost: a request at version v reused a cache entry of another version
    inflight,    \* a request is running (its versions recorded when it started)
    paused,      \* a pause is held (the caller's, until resume)
    partial,     \* kv_cache is asleep while the weights are awake (PARTIAL, or NEEDS_RELOAD from it)
    epoch,       \* restarts so far
    durable,     \* the committed version lives in a directory (or is the checkpoint's)
    saved,       \* the version the durable source holds: what a restart from it brings back
    savedMemory, \* a ghost (kept by the witness save_then_restart and the bug save_stale only):
                 \* the durable source is a save of a version that came from memory
    floor,       \* a restart lost a version that lived in memory only: no update below it
    peak,        \* a ghost: the highest version committed since the caller last reset the version
    reverted,    \* a ghost: a request ran below `peak`
    witnessed    \* a ghost: the situation Witness names happened

vars == <<stage, committed, task, from, target, disk, pending, answer, wstate, version, host, mixed, woke,
          cache, stale, inflight, paused, partial, epoch, durable, saved, savedMemory, floor, peak, reverted,
          witnessed>>
versionVars == <<committed, durable, saved, savedMemory, floor, peak, epoch>>

Saw(label) == witnessed' = (witnessed \/ label = Witness)

Init ==
    /\ stage = "RUNNING" /\ committed = 0 /\ task = FALSE /\ from = "RUNNING" /\ target = 0 /\ disk = TRUE
    /\ pending = {} /\ answer = [r \in Ranks |-> "none"]
    /\ wstate = [r \in Ranks |-> "ACTIVE"] /\ version = [r \in Ranks |-> 0]
    /\ host = [r \in Ranks |-> NONE] /\ mixed = FALSE /\ woke = FALSE
    /\ cache = [r \in Ranks |-> {}] /\ stale = FALSE
    /\ inflight = FALSE /\ paused = FALSE /\ partial = FALSE
    /\ epoch = 0 /\ durable = TRUE /\ saved = 0 /\ savedMemory = FALSE
    /\ floor = 0 /\ peak = 0 /\ reverted = FALSE /\ witnessed = FALSE

\* update_weights(v) from a directory or from memory: in RUNNING a drain first (it waits for the
\* request in flight), else at once. Refused below the floor a restart set.
IssueUpdate(v, fromDisk) ==
    /\ ~task /\ pending = {} /\ v > committed
    /\ v >= floor \/ Bug = "floor_ignored"
    /\ Has(StageRows, stage, "update_drain") \/ Has(StageRows, stage, "update")
       \/ (Has(StageRows, stage, "update_asleep") /\ \A r \in Ranks : host[r] # NONE)
    /\ LET draining == Has(StageRows, stage, "update_drain") /\ inflight
       IN /\ stage' = IF Has(StageRows, stage, "update_asleep") THEN S(stage, "update_asleep")
                      ELSE IF ~Has(StageRows, stage, "update_drain") THEN S(stage, "update")
                      ELSE IF draining THEN S(stage, "update_drain")
                      ELSE S(S(stage, "update_drain"), "update_drained")
          /\ pending' = IF draining THEN {} ELSE Ranks
          /\ Saw(CASE draining -> "drain_before_update"
                   [] stage = "PARTIAL" -> "update_from_partial"
                   [] stage = "PAUSED" -> "update_from_paused"
                   [] stage = "SLEEPING" -> "refit_asleep"
                   [] OTHER -> "none")
    /\ task' = TRUE /\ from' = stage /\ target' = v /\ disk' = fromDisk
    /\ answer' = [r \in Ranks |-> "none"] /\ woke' = FALSE
    /\ UNCHANGED <<committed, wstate, version, host, mixed, cache, stale, inflight, paused, partial>>
    /\ UNCHANGED <<epoch, durable, saved, savedMemory, floor, peak, reverted>>

\* A rank writes every bucket, drops its derived cache and ACKs the version; its clean host
\* copy is now stale. A sleeping rank writes its host copy instead, its device untouched
\* (bugs: refit_old_host writes nowhere, refit_on_device maps the weights to write them).
RankApply(r) ==
    /\ r \in pending
    /\ LET refit == wstate[r] = "SLEEPING"
       IN /\ wstate' = [wstate EXCEPT ![r] = W(W(@, Upd(@)),
                             IF refit THEN RefitSettle.rank ELSE IF partial THEN PartialSettle.rank
                             ELSE UpdateSettle.rank)]
          /\ version' = IF refit /\ Bug # "refit_on_device" THEN version ELSE [version EXCEPT ![r] = target]
          /\ host' = CASE refit /\ Bug = "refit_old_host" -> host
                      [] refit -> [host EXCEPT ![r] = target]
                      [] Bug = "stale_host_copy" -> host
                      [] OTHER -> [host EXCEPT ![r] = NONE]
    /\ cache' = IF Bug = "no_flush" THEN cache ELSE [cache EXCEPT ![r] = {}]
    /\ answer' = [answer EXCEPT ![r] = "ack"] /\ pending' = pending \ {r}
    /\ UNCHANGED <<stage, committed, task, from, target, disk, mixed, woke, stale, inflight, paused, partial>>
    /\ UNCHANGED <<epoch, durable, saved, savedMemory, floor, peak, reverted, witnessed>>

\* A name, shape, dtype or handle refused before anything is written.
RankRefuse(r) ==
    /\ RankFails /\ r \in pending
    /\ wstate' = [wstate EXCEPT ![r] = W(W(@, Upd(@)), WorkerRefused[@])]
    /\ answer' = [answer EXCEPT ![r] = "refused"] /\ pending' = pending \ {r}
    /\ UNCHANGED <<stage, committed, task, from, target, disk, version, host, mixed, woke, cache, stale>>
    /\ UNCHANGED <<inflight, paused, partial, epoch, durable, saved, savedMemory, floor, peak, reverted, witnessed>>

\* The update fails once writing began: NEEDS_RELOAD, reporting the version it had; a sleeping
\* rank stays asleep, its host copy standing for no version.
RankFail(r) ==
    /\ RankFails /\ r \in pending
    /\ wstate' = [wstate EXCEPT ![r] = W(W(@, Upd(@)),
                                         IF @ = "SLEEPING" THEN RefitSettle.rankFailed ELSE "update_failed")]
    /\ host' = [host EXCEPT ![r] = NONE]
    /\ answer' = [answer EXCEPT ![r] = "failed"] /\ pending' = pending \ {r}
    /\ UNCHANGED <<stage, committed, task, from, target, disk, version, mixed, woke, cache, stale>>
    /\ UNCHANGED <<inflight, paused, partial, epoch, durable, saved, savedMemory, floor, peak, reverted, witnessed>>

Acked == {r \in Ranks : answer[r] = "ack"}
Range(f) == {f[x] : x \in DOMAIN f}

\* The trigger a complete ACK set commits by: a refit stays asleep, a held pause stays, tags
\* asleep stay asleep; and the one every rank failing fires.
Commit(start, isPaused, isPartial) ==
    IF start = "SLEEPING" THEN RefitSettle.stage
    ELSE IF isPaused THEN "update_paused" ELSE IF isPartial THEN PartialSettle.stage ELSE UpdateSettle.stage
Failed(start) == IF start = "SLEEPING" THEN RefitSettle.stageFailed ELSE "update_failed"

\* Where the stage goes on the answers so far, and whether it commits the update: it waits
\* until every rank answered (P-5), then commits on a complete ACK set, returns where it
\* started when all refused, is NEEDS_RELOAD when all failed and FAILED when they differ.
\* (`Fired`: the rows' next states, S in the actions, TS in the assumption below.)
RuleBy(Fired(_, _), start, isPaused, isPartial, answers) ==
    CASE "none" \in Range(answers) -> <<"WAKING", FALSE>>
      [] Range(answers) = {"ack"} -> <<Fired("WAKING", Commit(start, isPaused, isPartial)), TRUE>>
      [] Range(answers) = {"refused"} -> <<Fired("WAKING", StageRefused[start]), FALSE>>
      [] Range(answers) = {"failed"} -> <<Fired("WAKING", Failed(start)), FALSE>>
      [] OTHER -> <<Fired("WAKING", "fail"), FALSE>>
Rule(start, isPaused, isPartial, answers) == RuleBy(S, start, isPaused, isPartial, answers)

\* The stage core settles every combination of answers of 2 ranks as Rule does.
ASSUME \A row \in SettleRows : RuleBy(TS, row[1], row[2], row[3], row[4]) = <<row[5], row[6]>>

Settle ==
    /\ task /\ stage = "WAKING"
    /\ LET rule == IF Bug = "commit_early" /\ Acked # {} THEN <<S(stage, UpdateSettle.stage), TRUE>>
                   ELSE Rule(from, paused, partial, answer)
       IN /\ rule[1] # "WAKING"
          /\ stage' = rule[1]
          /\ committed' = IF rule[2] THEN target ELSE committed
          \* A commit from memory leaves the durable source behind (bug save_stale: not where it
          \* is a save, which a restart then brings back at the older version).
          /\ durable' = IF ~rule[2] THEN durable
                        ELSE disk \/ (Bug = "save_stale" /\ durable /\ savedMemory)
          /\ saved' = IF rule[2] /\ disk THEN target ELSE saved
          /\ savedMemory' = (savedMemory /\ ~rule[2])
          /\ floor' = IF rule[2] /\ target >= floor THEN 0 ELSE floor
          /\ peak' = IF rule[2] THEN Max(peak, target) ELSE peak
          /\ Saw(CASE rule[1] = "FAILED" /\ Cardinality(Range(answer)) > 1 -> "mixed_answers"
                   [] from = "SLEEPING" /\ Range(answer) = {"failed"} -> "refit_lost"
                   [] OTHER -> "none")
    \* The task's own fields mean nothing once it settled: back to one value (fewer states).
    /\ task' = FALSE /\ from' = "RUNNING" /\ target' = 0 /\ disk' = TRUE /\ answer' = [r \in Ranks |-> "none"]
    /\ UNCHANGED <<pending, wstate, version, host, mixed, woke, cache, stale>>
    /\ UNCHANGED <<inflight, paused, partial, epoch, reverted>>

\* A request starts on every rank and records the versions that serve it. Each rank may reuse
\* any entry of its cache (a prefix hit: every entry is recorded, so one of another version
\* is seen) and keeps an entry computed now, at its version.
Serve ==
    /\ ~inflight
    /\ Has(StageRows, stage, "execute") /\ \A r \in Ranks : Has(WorkerRows, wstate[r], "execute")
    /\ mixed' = (mixed \/ Cardinality({version[r] : r \in Ranks}) > 1)
    /\ stale' = (stale \/ \E r \in Ranks : \E e \in cache[r] : e # version[r])
    /\ cache' = [r \in Ranks |-> cache[r] \cup {version[r]}]
    /\ reverted' = (reverted \/ \E r \in Ranks : version[r] < peak)
    /\ inflight' = TRUE
    /\ UNCHANGED <<stage, committed, task, from, target, disk, pending, answer, wstate, version, host, woke>>
    /\ UNCHANGED <<paused, partial, epoch, durable, saved, savedMemory, floor, peak, witnessed>>

\* The request ends; an update that drained for it goes out now.
Finish ==
    /\ inflight
    /\ inflight' = FALSE
    /\ IF stage = "DRAINING" /\ task
       THEN stage' = S(stage, "update_drained") /\ pending' = Ranks
       ELSE UNCHANGED <<stage, pending>>
    /\ UNCHANGED <<committed, task, from, target, disk, answer, wstate, version, host, mixed, woke, cache, stale>>
    /\ UNCHANGED <<paused, partial, epoch, durable, saved, savedMemory, floor, peak, reverted, witnessed>>

\* Level-1 sleep: copy to the host unless the clean copy is still valid. From RUNNING it drains
\* first; a PAUSED stage has nothing in flight to drain, and its pause holds while it sleeps.
Sleep ==
    /\ ~task /\ ~inflight /\ pending = {}
    /\ Has(StageRows, stage, "drain") \/ (stage = "PAUSED" /\ Has(StageRows, stage, "sleep"))
    /\ stage' = IF stage = "PAUSED" THEN S(S(stage, "sleep"), "slept") ELSE S(S(S(stage, "drain"), "drained"), "slept")
    /\ wstate' = [r \in Ranks |-> W(W(wstate[r], "sleep"), "offloaded")]
    /\ host' = [r \in Ranks |-> IF host[r] = NONE THEN version[r] ELSE host[r]]
    /\ version' = [r \in Ranks |-> NONE]
    /\ woke' = FALSE
    /\ UNCHANGED <<committed, task, from, target, disk, pending, answer, mixed, cache, stale, inflight>>
    /\ UNCHANGED <<paused, partial, epoch, durable, saved, savedMemory, floor, peak, reverted, witnessed>>

\* Wake of every tag: the weights come back from the host copy (which stays valid); from
\* PARTIAL they are resident already. A stage paused before it slept is PAUSED after it.
Wake ==
    /\ stage \in {"SLEEPING", "PARTIAL"}
    /\ stage = "SLEEPING" => \A r \in Ranks : host[r] # NONE
    /\ stage' = S(S(stage, "wake"), IF paused THEN "woke_paused" ELSE WakeSettle.stage)
    /\ wstate' = [r \in Ranks |-> W(W(wstate[r], "wake"), WakeSettle.rank)]
    /\ version' = IF stage = "SLEEPING" THEN host ELSE version
    /\ woke' = TRUE /\ partial' = FALSE
    /\ UNCHANGED <<committed, task, from, target, disk, pending, answer, host, mixed, cache, stale, inflight>>
    /\ UNCHANGED <<paused, epoch, durable, saved, savedMemory, floor, peak, reverted, witnessed>>

\* The wake of ranks whose host copies stand for no version (every rank failed a refit):
\* mapped but invalid, NEEDS_RELOAD, never served until an update or a reload.
WakeLost ==
    /\ stage = "SLEEPING" /\ \A r \in Ranks : host[r] = NONE
    /\ stage' = S(S(stage, "wake"), LostWakeSettle.stage)
    /\ wstate' = [r \in Ranks |-> W(W(wstate[r], "wake"), LostWakeSettle.rank)]
    /\ woke' = FALSE /\ partial' = FALSE
    /\ UNCHANGED <<committed, task, from, target, disk, pending, answer, version, host, mixed, cache, stale>>
    /\ UNCHANGED <<inflight, paused, epoch, durable, saved, savedMemory, floor, peak, reverted, witnessed>>

\* Wake of the weights alone: PARTIAL, kv_cache still asleep (of a stage not paused).
WakeWeights ==
    /\ stage = "SLEEPING" /\ ~paused /\ \A r \in Ranks : host[r] # NONE
    /\ stage' = S(S(stage, "wake"), PartialWakeSettle.stage)
    /\ wstate' = [r \in Ranks |-> W(W(wstate[r], "wake"), PartialWakeSettle.rank)]
    /\ version' = host
    /\ partial' = TRUE /\ woke' = FALSE
    /\ UNCHANGED <<committed, task, from, target, disk, pending, answer, host, mixed, cache, stale, inflight>>
    /\ UNCHANGED <<paused, epoch, durable, saved, savedMemory, floor, peak, reverted, witnessed>>

Pause ==
    /\ ~task /\ ~inflight /\ Has(StageRows, stage, "pause_drain")
    /\ stage' = S(S(stage, "pause_drain"), "pause_drained") /\ paused' = TRUE
    /\ UNCHANGED <<committed, task, from, target, disk, pending, answer, wstate, version, host, mixed, woke>>
    /\ UNCHANGED <<cache, stale, inflight, partial, epoch, durable, saved, savedMemory, floor, peak, reverted, witnessed>>

Resume ==
    /\ Has(StageRows, stage, "resume")
    /\ stage' = S(stage, "resume") /\ paused' = FALSE
    /\ UNCHANGED <<committed, task, from, target, disk, pending, answer, wstate, version, host, mixed, woke>>
    /\ UNCHANGED <<cache, stale, inflight, partial, epoch, durable, saved, savedMemory, floor, peak, reverted, witnessed>>

\* Fresh ranks under a new epoch (no task in flight). From the checkpoint when the caller asks
\* (`reset`: version 0, and it says so); else from the committed version's directory; else
\* (the version lived in memory only) NEEDS_RELOAD at the checkpoint under a floor. The bug
\* silent_revert starts every restart from the checkpoint without a word. Back is at the version
\* the durable source holds (`saved`, the committed one while `durable`; bug save_stale: not).
Restart(reset) ==
    /\ ~task /\ ~inflight /\ epoch < MaxRestarts /\ Has(StageRows, stage, "restart")
    /\ LET lost == Max(committed, floor)
           fromCheckpoint == reset \/ Bug = "silent_revert"
           back == ~fromCheckpoint /\ durable /\ lost = committed
           needs == ~fromCheckpoint /\ ~back
       IN /\ stage' = S(S(stage, "restart"), IF needs THEN "started_needs_reload" ELSE "started")
          /\ wstate' = [r \in Ranks |-> W("LOADING", IF needs THEN "loaded_needs_reload" ELSE "loaded")]
          /\ version' = [r \in Ranks |-> IF back THEN saved ELSE 0]
          /\ committed' = IF back THEN saved ELSE 0
          /\ durable' = ~needs
          /\ saved' = IF back THEN saved ELSE 0
          /\ savedMemory' = (back /\ savedMemory)
          /\ floor' = IF needs THEN lost ELSE 0
          /\ peak' = IF reset THEN 0 ELSE peak
          /\ Saw(CASE reset -> "restart_reset"
                   [] needs -> "restart_needs_reload"
                   [] savedMemory -> "save_then_restart"
                   [] committed > 0 -> "restart_after_update"
                   [] OTHER -> "none")
    /\ epoch' = epoch + 1
    /\ host' = [r \in Ranks |-> NONE] /\ cache' = [r \in Ranks |-> {}]
    /\ paused' = FALSE /\ partial' = FALSE /\ woke' = FALSE
    /\ answer' = [r \in Ranks |-> "none"]
    /\ UNCHANGED <<task, from, target, disk, pending, mixed, stale, inflight, reverted>>

\* SaveWeights (P-21): every rank writes the version it holds to a directory, where the stage's
\* weights are valid and awake (its save_weights rows: RUNNING, PAUSED, PARTIAL, the model's
\* PARTIAL having the weights awake) and no task is in flight; requests go on. No state, weights
\* or version changes; once every rank ACKed, that directory holds the committed version, which a
\* restart brings back from now on. (A save that a rank refuses records nothing: a stutter.)
Save ==
    /\ ~task /\ pending = {}
    /\ Has(StageRows, stage, "save_weights") /\ \A r \in Ranks : Has(WorkerRows, wstate[r], "save_weights")
    /\ stage' = S(stage, "save_weights")
    /\ wstate' = [r \in Ranks |-> W(wstate[r], "save_weights")]
    /\ durable' = TRUE /\ saved' = committed
    /\ savedMemory' = ((Witness = "save_then_restart" \/ Bug = "save_stale") /\ (savedMemory \/ ~durable))
    /\ UNCHANGED <<committed, task, from, target, disk, pending, answer, version, host, mixed, woke, cache>>
    /\ UNCHANGED <<stale, inflight, paused, partial, epoch, floor, peak, reverted, witnessed>>

\* The engine's shutdown (Engine.close) in any state with a stop row, the task and the request
\* in flight abandoned; every rank takes its Shutdown and the committed version stays. Only a
\* restart leaves STOPPED, so a stop is explored where one can follow (no end state).
Stop ==
    /\ epoch < MaxRestarts /\ Has(StageRows, stage, "stop")
    /\ stage' = S(stage, "stop")
    /\ wstate' = [r \in Ranks |-> W(wstate[r], "shutdown")]
    /\ task' = FALSE /\ from' = "RUNNING" /\ target' = 0 /\ disk' = TRUE /\ answer' = [r \in Ranks |-> "none"]
    /\ pending' = {} /\ inflight' = FALSE /\ paused' = FALSE /\ woke' = FALSE
    /\ UNCHANGED <<committed, version, host, mixed, cache, stale, partial, epoch, durable, saved, savedMemory, floor, peak>>
    /\ UNCHANGED <<reverted, witnessed>>

\* A rank's process dies (RankDied) where the stage has a fail row: FAILED, its task and the
\* request in flight abandoned; the ranks keep what they hold until a restart replaces them
\* (so a crash is explored where one can follow).
Crash ==
    /\ RankFails /\ epoch < MaxRestarts /\ Has(StageRows, stage, "fail")
    /\ stage' = S(stage, "fail")
    /\ task' = FALSE /\ from' = "RUNNING" /\ target' = 0 /\ disk' = TRUE /\ answer' = [r \in Ranks |-> "none"]
    /\ pending' = {} /\ inflight' = FALSE /\ woke' = FALSE
    /\ UNCHANGED <<committed, wstate, version, host, mixed, cache, stale, paused, partial, epoch, durable>>
    /\ UNCHANGED <<saved, savedMemory>>
    /\ UNCHANGED <<floor, peak, reverted, witnessed>>

Next ==
    \/ \E v \in Versions, d \in BOOLEAN : IssueUpdate(v, d)
    \/ \E r \in Ranks : RankApply(r) \/ RankRefuse(r) \/ RankFail(r)
    \/ Settle \/ Serve \/ Finish \/ Sleep \/ Wake \/ WakeLost \/ WakeWeights \/ Pause \/ Resume
    \/ \E reset \in BOOLEAN : Restart(reset)
    \/ Save \/ Stop \/ Crash

Spec == Init /\ [][Next]_vars

StatesOf(rows) == {row[1] : row \in rows} \cup {row[3] : row \in rows}

TypeOK ==
    /\ stage \in StatesOf(StageRows) /\ from \in StatesOf(StageRows)
    /\ wstate \in [Ranks -> StatesOf(WorkerRows)]
    /\ committed \in Versions /\ target \in Versions /\ task \in BOOLEAN /\ woke \in BOOLEAN
    /\ disk \in BOOLEAN /\ inflight \in BOOLEAN /\ paused \in BOOLEAN /\ partial \in BOOLEAN
    /\ pending \subseteq Ranks
    /\ answer \in [Ranks -> {"none", "ack", "refused", "failed"}]
    /\ version \in [Ranks -> Versions \cup {NONE}]
    /\ host \in [Ranks -> Versions \cup {NONE}]
    /\ mixed \in BOOLEAN /\ stale \in BOOLEAN
    /\ cache \in [Ranks -> SUBSET Versions]
    /\ epoch \in 0..MaxRestarts /\ durable \in BOOLEAN /\ saved \in Versions /\ savedMemory \in BOOLEAN
    /\ floor \in Versions /\ peak \in Versions
    /\ reverted \in BOOLEAN /\ witnessed \in BOOLEAN

NoMixedVersions == ~mixed
WakeRestoresCommitted == woke => \A r \in Ranks : version[r] = committed
\* No request committed at version v uses a cache entry computed under another version.
CacheFollowsVersion == ~stale
\* Versions never go backwards across epochs unless the caller reset them: no request runs
\* below the highest version committed since the last reset, and a floor names that version.
NoSilentRevert == ~reverted /\ (floor > 0 => floor <= peak)
\* The durable source holds the committed version: what a restart back brings is it.
SavedIsCommitted == durable => saved = committed
\* A sleeping rank holds no weights on its device: a refit writes the host copy, so the old
\* and the new version are never there at once.
NothingOnDeviceAsleep == \A r \in Ranks : wstate[r] = "SLEEPING" => version[r] = NONE
\* A witness model checks this one and expects it violated: TLC reached the situation.
WitnessUnseen == ~witnessed
===================================================================================

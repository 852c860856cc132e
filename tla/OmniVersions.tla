------------------------------- MODULE OmniVersions -------------------------------
(***************************************************************************)
(* Versioned weight updates (P-17): one stage of ranks, each with the     *)
(* weights version resident on its device, the version its backend's      *)
(* clean host copy holds (or none), and its worker state. The stage        *)
(* updates every rank to a version above the committed one (draining     *)
(* first in RUNNING); each rank writes it and ACKs, refuses it before     *)
(* writing, or fails once writing began (NEEDS_RELOAD at its old          *)
(* version). The stage commits only on a complete ACK set; requests run   *)
(* only in RUNNING and record the versions of the ranks that served them. *)
(* A level-1 sleep copies the weights to the host unless the clean copy   *)
(* is still valid; a wake restores from that copy.                        *)
(*                                                                         *)
(* Each rank keeps a cache derived from its weights (vLLM's prefix KV    *)
(* blocks): every entry carries the version it was computed under, and a  *)
(* request may reuse any entry its rank holds. A rank drops the cache     *)
(* when it writes an update, before it ACKs.                              *)
(*                                                                         *)
(* What must hold: no request runs on mixed versions, after a wake every  *)
(* rank holds the last committed version (an update invalidates the clean *)
(* host copy, so the next sleep copies again), and no request that ran at *)
(* version v reused a cache entry of another version.                     *)
(*                                                                         *)
(* Every worker and stage step comes from VersionTable.tla, GENERATED     *)
(* from omni_core/fsm (omni_core.formal.gen_versions): firing a trigger   *)
(* the tables lack stops TLC, and the ASSUMEs below check what this spec  *)
(* relies on of the rows; SettleRows, the StageCore's own answer to every *)
(* combination of ranks' answers, must be what the spec's Rule says.      *)
(***************************************************************************)
EXTENDS Integers, FiniteSets, TLC, VersionTable

CONSTANTS
    Ranks,       \* the stage's ranks
    MaxVersion,  \* updates go to versions 1..MaxVersion
    RankFails,   \* a rank may refuse or fail an update
    Bug          \* "none" | "commit_early" | "stale_host_copy" | "no_flush"

NONE == -1        \* no weights resident (asleep) / no valid host copy
Versions == 0..MaxVersion

Has(rows, s, t) == \E row \in rows : row[1] = s /\ row[2] = t
Fire(rows, who, s, t) ==
    IF Has(rows, s, t) THEN (CHOOSE row \in rows : row[1] = s /\ row[2] = t)[3]
    ELSE Assert(FALSE, <<who, "fires a trigger its table forbids", s, t>>)
W(s, t) == Fire(WorkerRows, "a rank", s, t)
S(s, t) == Fire(StageRows, "the stage", s, t)

\* What the spec relies on of the generated rows.
ASSUME \A row \in StageRows : row[2] = "execute" => row[1] = "RUNNING"         \* P-7
ASSUME \A row \in WorkerRows : row[2] = "execute" => row[1] = "ACTIVE"
ASSUME \A row \in StageRows \cup WorkerRows : row[2] = "update_failed" => row[3] = "NEEDS_RELOAD"
ASSUME \A s \in {"ACTIVE", "NEEDS_RELOAD"} : W(W(s, "update"), WorkerRefused[s]) = s
ASSUME \A s \in {"RUNNING", "NEEDS_RELOAD"} : S("WAKING", StageRefused[s]) = s
ASSUME S("WAKING", UpdateSettle.stage) = "RUNNING" /\ W(W("ACTIVE", "update"), UpdateSettle.rank) = "ACTIVE"

VARIABLES
    stage,       \* the stage's state
    committed,   \* the version the stage committed last
    task,        \* the stage's update task is open (it has not settled)
    from,        \* the stage state the update started in
    target,      \* the version the update in flight writes
    pending,     \* ranks the update has not reached yet
    answer,      \* rank -> "none" | "ack" | "refused" | "failed"
    wstate,      \* rank -> its worker state
    version,     \* rank -> the version resident on its device (NONE while asleep)
    host,        \* rank -> the version its clean host copy holds (NONE: none or invalid)
    served,      \* the set of version sets requests ran on
    woke,        \* a ghost: the last lifecycle step was a wake
    cache,       \* rank -> the versions its derived-cache entries were computed under
    reused       \* the set of <<version a request ran at, version of an entry it reused>>

vars == <<stage, committed, task, from, target, pending, answer, wstate, version, host, served, woke, cache, reused>>

Init ==
    /\ stage = "RUNNING" /\ committed = 0 /\ task = FALSE /\ from = "RUNNING" /\ target = 0
    /\ pending = {} /\ answer = [r \in Ranks |-> "none"]
    /\ wstate = [r \in Ranks |-> "ACTIVE"] /\ version = [r \in Ranks |-> 0]
    /\ host = [r \in Ranks |-> NONE] /\ served = {} /\ woke = FALSE
    /\ cache = [r \in Ranks |-> {}] /\ reused = {}

\* update_weights(v): in RUNNING a drain first (no request is in flight here), else at once.
IssueUpdate(v) ==
    /\ ~task /\ pending = {} /\ v > committed
    /\ Has(StageRows, stage, "update_drain") \/ Has(StageRows, stage, "update")
    /\ stage' = IF Has(StageRows, stage, "update_drain")
                THEN S(S(stage, "update_drain"), "update_drained") ELSE S(stage, "update")
    /\ task' = TRUE /\ from' = stage /\ target' = v /\ pending' = Ranks
    /\ answer' = [r \in Ranks |-> "none"] /\ woke' = FALSE
    /\ UNCHANGED <<committed, wstate, version, host, served, cache, reused>>

\* A rank writes every bucket, drops its derived cache and ACKs the version; its clean host
\* copy is now stale.
RankApply(r) ==
    /\ r \in pending
    /\ wstate' = [wstate EXCEPT ![r] = W(W(@, "update"), UpdateSettle.rank)]
    /\ version' = [version EXCEPT ![r] = target]
    /\ host' = IF Bug = "stale_host_copy" THEN host ELSE [host EXCEPT ![r] = NONE]
    /\ cache' = IF Bug = "no_flush" THEN cache ELSE [cache EXCEPT ![r] = {}]
    /\ answer' = [answer EXCEPT ![r] = "ack"] /\ pending' = pending \ {r}
    /\ UNCHANGED <<stage, committed, task, from, target, served, woke, reused>>

\* A name, shape, dtype or handle refused before anything is written.
RankRefuse(r) ==
    /\ RankFails /\ r \in pending
    /\ wstate' = [wstate EXCEPT ![r] = W(W(@, "update"), WorkerRefused[@])]
    /\ answer' = [answer EXCEPT ![r] = "refused"] /\ pending' = pending \ {r}
    /\ UNCHANGED <<stage, committed, task, from, target, version, host, served, woke, cache, reused>>

\* The update fails once writing began: NEEDS_RELOAD, reporting the version it had.
RankFail(r) ==
    /\ RankFails /\ r \in pending
    /\ wstate' = [wstate EXCEPT ![r] = W(W(@, "update"), "update_failed")]
    /\ host' = [host EXCEPT ![r] = NONE]
    /\ answer' = [answer EXCEPT ![r] = "failed"] /\ pending' = pending \ {r}
    /\ UNCHANGED <<stage, committed, task, from, target, version, served, woke, cache, reused>>

Acked == {r \in Ranks : answer[r] = "ack"}
Range(f) == {f[x] : x \in DOMAIN f}

\* Where the stage goes on the answers so far, and whether it commits the update: it waits
\* until every rank answered (P-5), then commits on a complete ACK set, returns where it
\* started when all refused, is NEEDS_RELOAD when all failed and FAILED when they differ.
Rule(start, answers) ==
    CASE "none" \in Range(answers) -> <<"WAKING", FALSE>>
      [] Range(answers) = {"ack"} -> <<S("WAKING", UpdateSettle.stage), TRUE>>
      [] Range(answers) = {"refused"} -> <<S("WAKING", StageRefused[start]), FALSE>>
      [] Range(answers) = {"failed"} -> <<S("WAKING", "update_failed"), FALSE>>
      [] OTHER -> <<S("WAKING", "fail"), FALSE>>

\* The stage core settles every combination of answers of 2 ranks as Rule does.
ASSUME \A row \in SettleRows : Rule(row[1], row[2]) = <<row[3], row[4]>>

Settle ==
    /\ task /\ stage = "WAKING"
    /\ LET rule == IF Bug = "commit_early" /\ Acked # {} THEN <<S(stage, UpdateSettle.stage), TRUE>>
                   ELSE Rule(from, answer)
       IN /\ rule[1] # "WAKING"
          /\ stage' = rule[1]
          /\ committed' = IF rule[2] THEN target ELSE committed
    /\ task' = FALSE
    /\ UNCHANGED <<from, target, pending, answer, wstate, version, host, served, woke, cache, reused>>

\* A request runs on every rank and records the versions that served it. Each rank may reuse
\* any entry of its cache (a prefix hit: every entry is recorded, so one of another version
\* is seen) and keeps an entry computed now, at its version.
Serve ==
    /\ Has(StageRows, stage, "execute") /\ \A r \in Ranks : Has(WorkerRows, wstate[r], "execute")
    /\ served' = served \cup {{version[r] : r \in Ranks}}
    /\ reused' = reused \cup UNION {{<<version[r], e>> : e \in cache[r]} : r \in Ranks}
    /\ cache' = [r \in Ranks |-> cache[r] \cup {version[r]}]
    /\ UNCHANGED <<stage, committed, task, from, target, pending, answer, wstate, version, host, woke>>

\* Level-1 sleep: copy to the host unless the clean copy is still valid.
Sleep ==
    /\ ~task /\ pending = {} /\ Has(StageRows, stage, "drain")
    /\ stage' = S(S(S(stage, "drain"), "drained"), "slept")
    /\ wstate' = [r \in Ranks |-> W(W(wstate[r], "sleep"), "offloaded")]
    /\ host' = [r \in Ranks |-> IF host[r] = NONE THEN version[r] ELSE host[r]]
    /\ version' = [r \in Ranks |-> NONE]
    /\ woke' = FALSE
    /\ UNCHANGED <<committed, task, from, target, pending, answer, served, cache, reused>>

\* Wake: every rank restores its weights from its host copy (which stays valid).
Wake ==
    /\ stage = "SLEEPING"
    /\ stage' = S(S(stage, "wake"), WakeSettle.stage)
    /\ wstate' = [r \in Ranks |-> W(W(wstate[r], "wake"), WakeSettle.rank)]
    /\ version' = host
    /\ woke' = TRUE
    /\ UNCHANGED <<committed, task, from, target, pending, answer, host, served, cache, reused>>

Next ==
    \/ \E v \in Versions : IssueUpdate(v)
    \/ \E r \in Ranks : RankApply(r) \/ RankRefuse(r) \/ RankFail(r)
    \/ Settle \/ Serve \/ Sleep \/ Wake

Spec == Init /\ [][Next]_vars

StatesOf(rows) == {row[1] : row \in rows} \cup {row[3] : row \in rows}

TypeOK ==
    /\ stage \in StatesOf(StageRows) /\ from \in StatesOf(StageRows)
    /\ wstate \in [Ranks -> StatesOf(WorkerRows)]
    /\ committed \in Versions /\ target \in Versions /\ task \in BOOLEAN /\ woke \in BOOLEAN
    /\ pending \subseteq Ranks
    /\ answer \in [Ranks -> {"none", "ack", "refused", "failed"}]
    /\ version \in [Ranks -> Versions \cup {NONE}]
    /\ host \in [Ranks -> Versions \cup {NONE}]
    /\ served \subseteq SUBSET Versions
    /\ cache \in [Ranks -> SUBSET Versions]
    /\ reused \subseteq Versions \X Versions

NoMixedVersions == \A vs \in served : Cardinality(vs) = 1
WakeRestoresCommitted == woke => \A r \in Ranks : version[r] = committed
\* No request committed at version v uses a cache entry computed under another version.
CacheFollowsVersion == \A pair \in reused : pair[1] = pair[2]
===================================================================================

-------------------------------- MODULE OmniBatch --------------------------------
(***************************************************************************)
(* Many requests in flight per rank: the stage sends up to MaxInFlight     *)
(* requests to every rank at once, and each rank runs the requests it      *)
(* holds as one batch (WorkerCore._running; the shell hands them to the    *)
(* runner together and answers each as it finishes, in any order).        *)
(*                                                                         *)
(* What a rank must keep: nothing else starts beside a batch (a Sleep that *)
(* arrives while requests run is refused BUSY, whoever sent it: the peer   *)
(* is hostile, so Sleeps come at any time here), a batch never grows past  *)
(* MaxInFlight, and a request runs only in ACTIVE. What the stage must     *)
(* keep: every request is answered exactly once, and when a rank dies the  *)
(* stage fails every request still in flight, those the dead rank had      *)
(* answered already included (another rank may still hold them).          *)
(*                                                                         *)
(* Legality and next states come from the generated OmniTransitions (the   *)
(* tables). Bug models (tla/bugs/batch_*.cfg):                             *)
(*   sleep_beside_batch    the rank's BUSY check sees the lifecycle effect *)
(*                         only, not the batch: a Sleep starts while a     *)
(*                         request runs (Batch_NothingBesideABatch)        *)
(*   answer_lost_on_crash  a dead rank fails only the requests it still    *)
(*                         held: one it had answered, still running on     *)
(*                         another rank, is never answered                 *)
(*                         (Batch_NoneLostOnFailure)                       *)
(***************************************************************************)
EXTENDS Naturals, FiniteSets, OmniTransitions

CONSTANTS
    Ranks,          \* model values
    MaxInFlight,    \* StageSpec.max_in_flight: requests per stage, and so per rank
    MaxTask,        \* request ids 1..MaxTask
    Crashes,        \* TRUE: a rank may die once
    Bug             \* "none" | "sleep_beside_batch" | "answer_lost_on_crash"

ASSUME Bug \in {"none", "sleep_beside_batch", "answer_lost_on_crash"}
ASSUME MaxInFlight \in Nat \ {0} /\ MaxTask \in Nat /\ Crashes \in BOOLEAN

TaskIds == 1..MaxTask
NoPend == "none"

VARIABLES
    wstate,     \* rank -> worker state (the table's)
    alive,      \* rank -> its process lives
    wrun,       \* rank -> the requests of its batch (WorkerCore._running)
    wpend,      \* rank -> the lifecycle effect in progress ("Sleep") or NoPend
    strayed,    \* rank -> a hostile Sleep was sent to it (at most one each)
    sstate,     \* the stage's state (the table's)
    sreqs,      \* requests in flight: sent to every rank, not yet answered
    sreplies,   \* request -> ranks that answered it
    answers,    \* request -> how often its caller was answered (ghost: exactly once)
    seenDead,   \* ranks whose death the stage took
    nextTask,
    net         \* messages in flight: commands to ranks, replies to the stage

vars == <<wstate, alive, wrun, wpend, strayed, sstate, sreqs, sreplies, answers, seenDead, nextTask, net>>

Cmd(type, t, r) == [kind |-> "cmd", type |-> type, task |-> t, rank |-> r]
Reply(kind, t, r) == [kind |-> kind, type |-> "-", task |-> t, rank |-> r]

Init ==
    /\ wstate = [r \in Ranks |-> WorkerNext(WorkerInitial, "loaded")]
    /\ alive = [r \in Ranks |-> TRUE]
    /\ wrun = [r \in Ranks |-> {}]
    /\ wpend = [r \in Ranks |-> NoPend]
    /\ strayed = [r \in Ranks |-> FALSE]
    /\ sstate = "RUNNING"
    /\ sreqs = {}
    /\ sreplies = [t \in TaskIds |-> {}]
    /\ answers = [t \in TaskIds |-> 0]
    /\ seenDead = {}
    /\ nextTask = 1
    /\ net = {}

(* ------------------------------- the rank -------------------------------- *)

(* WorkerCore._busy_with: one lifecycle effect at a time; beside a batch only more requests,
   up to MaxInFlight. *)
BusyFor(r, type) ==
    \/ wpend[r] # NoPend
    \/ wrun[r] # {} /\ type # "Execute" /\ Bug # "sleep_beside_batch"
    \/ type = "Execute" /\ Cardinality(wrun[r]) >= MaxInFlight

Receive(r, m) ==
    /\ m \in net /\ m.kind = "cmd" /\ m.rank = r /\ alive[r]
    /\ LET busy == BusyFor(r, m.type)
           runs == m.type = "Execute" /\ ~busy /\ WorkerLegal(wstate[r], "execute")
           sleeps == m.type = "Sleep" /\ ~busy /\ WorkerLegal(wstate[r], "sleep")
           refusal == Reply("nack", m.task, r)
       IN /\ wrun' = IF runs THEN [wrun EXCEPT ![r] = @ \cup {m.task}] ELSE wrun
          /\ wpend' = IF sleeps THEN [wpend EXCEPT ![r] = "Sleep"] ELSE wpend
          /\ wstate' = IF sleeps THEN [wstate EXCEPT ![r] = WorkerNext(@, "sleep")] ELSE wstate
          /\ net' = (net \ {m}) \cup (IF runs \/ sleeps THEN {} ELSE {refusal})
    /\ UNCHANGED <<alive, strayed, sstate, sreqs, sreplies, answers, seenDead, nextTask>>

(* One request of the batch finished (the runner answers each; any order): its Result. *)
Finish(r, t) ==
    /\ alive[r] /\ t \in wrun[r]
    /\ wrun' = [wrun EXCEPT ![r] = @ \ {t}]
    /\ net' = net \cup {Reply("result", t, r)}
    /\ UNCHANGED <<wstate, alive, wpend, strayed, sstate, sreqs, sreplies, answers, seenDead, nextTask>>

Offloaded(r) ==
    /\ alive[r] /\ wpend[r] = "Sleep"
    /\ wstate' = [wstate EXCEPT ![r] = WorkerNext(@, "offloaded")]
    /\ wpend' = [wpend EXCEPT ![r] = NoPend]
    /\ net' = net \cup {Reply("ack", 0, r)}
    /\ UNCHANGED <<alive, wrun, strayed, sstate, sreqs, sreplies, answers, seenDead, nextTask>>

(* A hostile peer's Sleep, at any time (the protocol's peers are not trusted). *)
StraySleep(r) ==
    /\ ~strayed[r]
    /\ strayed' = [strayed EXCEPT ![r] = TRUE]
    /\ net' = net \cup {Cmd("Sleep", 0, r)}
    /\ UNCHANGED <<wstate, alive, wrun, wpend, sstate, sreqs, sreplies, answers, seenDead, nextTask>>

(* The rank's process dies: its batch goes with it, unanswered. *)
Crash(r) ==
    /\ Crashes /\ alive[r] /\ \A q \in Ranks : alive[q]
    /\ alive' = [alive EXCEPT ![r] = FALSE]
    /\ wrun' = [wrun EXCEPT ![r] = {}]
    /\ wpend' = [wpend EXCEPT ![r] = NoPend]
    /\ UNCHANGED <<wstate, strayed, sstate, sreqs, sreplies, answers, seenDead, nextTask, net>>

(* ------------------------------- the stage ------------------------------- *)

Submit ==
    /\ StageLegal(sstate, "execute") /\ Cardinality(sreqs) < MaxInFlight /\ nextTask \in TaskIds
    /\ sreqs' = sreqs \cup {nextTask}
    /\ net' = net \cup {Cmd("Execute", nextTask, r) : r \in Ranks}
    /\ nextTask' = nextTask + 1
    /\ UNCHANGED <<wstate, alive, wrun, wpend, strayed, sstate, sreplies, answers, seenDead>>

(* A rank's answer to request t (a Result or a refusal): t retires once every rank answered;
   its caller is answered then. After a failure the stage ignores what comes. *)
TakeReply(m) ==
    /\ m \in net /\ m.kind \in {"result", "nack"} /\ m.task \in sreqs
    /\ LET t == m.task
           replied == sreplies[t] \cup {m.rank}
           done == replied = Ranks
       IN /\ sreplies' = [sreplies EXCEPT ![t] = replied]
          /\ sreqs' = IF done THEN sreqs \ {t} ELSE sreqs
          /\ answers' = IF done THEN [answers EXCEPT ![t] = @ + 1] ELSE answers
    /\ net' = net \ {m}
    /\ UNCHANGED <<wstate, alive, wrun, wpend, strayed, sstate, seenDead, nextTask>>

(* A reply the stage does not wait for: the Ack of a stray Sleep, a late answer. *)
DropReply(m) ==
    /\ m \in net /\ m.kind \in {"result", "nack", "ack"} /\ ~(m.kind # "ack" /\ m.task \in sreqs)
    /\ net' = net \ {m}
    /\ UNCHANGED <<wstate, alive, wrun, wpend, strayed, sstate, sreqs, sreplies, answers, seenDead, nextTask>>

(* StageCore._rank_died: the stage fails, and every request in flight is answered (FAILED). *)
RankDied(r) ==
    /\ ~alive[r] /\ r \notin seenDead
    /\ seenDead' = seenDead \cup {r}
    /\ sstate' = IF StageLegal(sstate, "fail") THEN StageNext(sstate, "fail") ELSE sstate
    /\ LET failed == IF Bug = "answer_lost_on_crash" THEN {t \in sreqs : r \notin sreplies[t]} ELSE sreqs
       IN answers' = [t \in TaskIds |-> IF t \in failed THEN answers[t] + 1 ELSE answers[t]]
    /\ sreqs' = {}
    /\ UNCHANGED <<wstate, alive, wrun, wpend, strayed, sreplies, nextTask, net>>

Next ==
    \/ \E r \in Ranks : \/ \E m \in net : Receive(r, m)
                        \/ \E t \in TaskIds : Finish(r, t)
                        \/ Offloaded(r) \/ StraySleep(r) \/ Crash(r) \/ RankDied(r)
    \/ Submit
    \/ \E m \in net : TakeReply(m) \/ DropReply(m)

Spec == Init /\ [][Next]_vars
FairSpec == Spec /\ WF_vars(Next)

(* ------------------------------- properties ------------------------------ *)

TypeOK ==
    /\ wstate \in [Ranks -> WorkerStates] /\ alive \in [Ranks -> BOOLEAN]
    /\ wrun \in [Ranks -> SUBSET TaskIds] /\ wpend \in [Ranks -> {NoPend, "Sleep"}]
    /\ sstate \in StageStates /\ sreqs \subseteq TaskIds /\ answers \in [TaskIds -> 0..2]
    /\ nextTask \in 1..(MaxTask + 1)

(* P-7 with a batch: nothing moves memory beside a running request, which runs only in ACTIVE. *)
Batch_NothingBesideABatch == \A r \in Ranks : wrun[r] # {} => wpend[r] = NoPend /\ wstate[r] = "ACTIVE"
Batch_Bounded == \A r \in Ranks : Cardinality(wrun[r]) <= MaxInFlight
(* P-1 for callers: no request is answered twice. *)
Batch_AnsweredOnce == \A t \in TaskIds : answers[t] <= 1
(* A failed stage holds nothing in flight, and every request it took was answered. *)
Batch_NoneLostOnFailure == sstate = "FAILED" => \A t \in 1..(nextTask - 1) : answers[t] = 1
(* Every request ever submitted is answered in the end (FairSpec). *)
Batch_EveryRequestAnswered == <>[](sreqs = {} /\ \A t \in 1..(nextTask - 1) : answers[t] = 1)
=============================================================================
